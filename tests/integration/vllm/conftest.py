"""vLLM's own processes serving pipecast packages: collected only by ``make test-vllm``, which builds vLLM's
environment (``vllm_plugin/setup_venv.sh``) and names it in ``PIPECAST_VLLM_VENV``. The main run (``make test``)
has no vLLM and leaves these files unread."""

from tests.support.vllm import vllm_venv

collect_ignore_glob = [] if vllm_venv() else ["test_*.py"]
