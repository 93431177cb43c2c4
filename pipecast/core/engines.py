"""What may answer at a serving worker's URL: pipecast's serving worker, or vLLM with pipecast's loader
(``vllm serve PACKAGE --load-format pipecast``). The agent registers it (``pipecast agent --engine``), the
control plane keeps it, the router polls each engine as it answers."""

SERVING_ENGINES = ("pipecast", "vllm")
DEFAULT_ENGINE = "pipecast"
