"""Pipelines of stages compute exactly what one node and transformers compute, and stages run while
their blocks arrive."""

import threading
import uuid
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from pipecast.engine.engine import Engine
from pipecast.engine.errors import InvalidRequestError
from pipecast.engine.providers import AgentBlockProvider, PackageFolderProvider
from pipecast.engine.sampling import SamplingParams
from pipecast.engine.stage import StageCapacityError, StageRunner, StageSessionError
from pipecast.engine.weights import EMBED, FINAL_NORM, HEAD
from tests.support import packages
from tests.support.engine_fixtures import GatedAgent, random_prompt, reference_generate, reference_model

LAYERS = 8
CASES = [  # llama and mistral untied, qwen2, qwen3 and gemma3 tied (the last stage needs the embeddings too)
    ("llama", "float32", {}),
    ("qwen2", "float32", {}),
    ("mistral", "float32", {"sliding_window": 6}),  # prompts and generations run past the window
    ("llama", "bfloat16", {}),
    ("gemma3_text", "float32", {}),  # sliding (window 6) and global layers, softcapped logits
    ("qwen3", "float32", {}),
    ("gemma3_text", "bfloat16", {}),
]
SPLITS = {2: (0, 4, 8), 3: (0, 3, 5, 8), 8: tuple(range(9))}


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-{c[1]}{'-window' if c[2] else ''}")
def case(request, tmp_path_factory):
    arch, dtype, overrides = request.param
    package = packages.tiny_package(tmp_path_factory.mktemp(arch) / "pkg", arch, dtype=dtype, layers=LAYERS,
                                    layers_per_block=2, seed=10 + CASES.index(request.param), **overrides)
    engine = Engine(PackageFolderProvider(package.path)).start()
    engine.wait_loaded(timeout=30)
    yield reference_model(package.checkpoint), engine
    engine.close()


def pipeline_generate(runners, cuts, prompt, params, *, logits=None):
    """Generate through stages ``runners[i]`` running layers ``cuts[i]..cuts[i+1]-1``, as a head stage does
    (with tied embeddings the last stage sends back its final norm and the first samples)."""
    session, tokens, position, step = uuid.uuid4().hex, [], 0, list(prompt)
    tied = len(runners) > 1 and runners[0].model.skeleton.tied_embeddings
    while len(tokens) < params.max_tokens:
        hidden = None
        for i, runner in enumerate(runners):
            out = runner.run(session, range(cuts[i], cuts[i + 1]), position, tokens=step if i == 0 else None,
                             hidden=hidden, params=params if position == 0 else None,
                             want_logits=logits is not None, norm_only=tied, timeout=30)
            hidden = out.hidden
        if tied:
            out = runners[0].sample(session, hidden, want_logits=logits is not None, timeout=30)
        if logits is not None:
            logits.append(out.logits)
        position += len(step)
        tokens.append(out.token)
        step = [out.token]
        if out.token in params.stop_token_ids:
            break
    for runner in runners:
        runner.close(session)
    return tokens


@pytest.mark.parametrize("stages", sorted(SPLITS))
def test_greedy_tokens_through_a_pipeline_equal_one_node_and_transformers(case, stages):
    ref, engine = case
    prompt = random_prompt(9, stages)
    expected = reference_generate(ref, prompt, 16)
    assert len(set(expected)) > 4  # the model is not degenerate: the comparison means something
    params = SamplingParams(max_tokens=16, stop_token_ids=[ref.generation_config.eos_token_id])
    runners = [StageRunner(engine.model) for _ in range(stages)]
    got = pipeline_generate(runners, SPLITS[stages], prompt, params)
    assert got == expected == engine.generate(prompt, params, timeout=30)
    assert all(r.sessions == 0 for r in runners)


def test_logits_at_every_step_equal_one_node_and_transformers(case):
    ref, engine = case
    prompt = random_prompt(7, 99)
    logits, whole = [], []
    params = SamplingParams(max_tokens=5)
    tokens = pipeline_generate([StageRunner(engine.model) for _ in range(3)], SPLITS[3], prompt, params,
                               logits=logits)
    assert pipeline_generate([StageRunner(engine.model)], (0, LAYERS), prompt, params, logits=whole) == tokens
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, min_new_tokens=5,
                           do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    assert tokens == out.sequences[0, len(prompt):].tolist()
    assert all(torch.equal(got, one) for got, one in zip(logits, whole, strict=True))  # stages add nothing
    # Against transformers: bitwise on most CPUs; in float32 within rounding on others. The engine's weights
    # are views of the block file, whose tensors safetensors aligns to their item size only, and a one-row
    # matrix-vector product (each decode step; the LM head on the last position) on an AVX-512 AMD EPYC sums
    # in an order that depends on the weight's address (a 64-byte aligned copy of the same weight, as the
    # reference holds, gives transformers' bits).
    tolerance = 1e-4 if engine.model.dtype == torch.float32 else 0
    for got, want in zip(logits, out.logits, strict=True):  # the prefill's, then each decode step's
        assert torch.allclose(got, want[0].float(), atol=tolerance, rtol=0)


def test_seeded_sampling_through_a_pipeline_equals_one_node(case):
    _, engine = case
    params = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=7)
    prompt = random_prompt(6, 5)
    runners = [StageRunner(engine.model) for _ in range(2)]
    assert pipeline_generate(runners, SPLITS[2], prompt, params) == engine.generate(prompt, params, timeout=30)


def test_a_request_moved_off_a_dissolving_pipeline_goes_on_with_the_single_node_tokens(case):
    """The head's move at dissolution (pipecast.serve.pipeline.PipelineHead): the prompt is prefilled on the whole
    model and the tokens so far fed one decode step each, as one node made them. Found in review: prefilled with the
    prompt, they gave other tokens after them in bf16 (16 of 66 moves of a tiny Llama; a prefill of many positions
    adds up in another order than one decode step)."""
    ref, engine = case
    for seed in (17, 3):
        prompt = random_prompt(8, seed)
        expected = reference_generate(ref, prompt, 16)
        stop = [ref.generation_config.eos_token_id]
        for moved_after in (m for m in (1, 2, 5, 9, 13) if m < len(expected)):  # not past a stop token
            so_far = pipeline_generate([StageRunner(engine.model) for _ in range(3)], SPLITS[3], prompt,
                                       SamplingParams(max_tokens=moved_after))
            rest = engine.submit(prompt, SamplingParams(max_tokens=16 - moved_after, stop_token_ids=stop),
                                 generated=so_far).result(30)
            assert so_far + rest == expected, (seed, moved_after)
    # Seeded sampling draws as one node did (found in review: the forced prefill step drew nothing, one draw short).
    sampled = SamplingParams(max_tokens=12, temperature=0.9, top_p=1.0, seed=5)
    whole = engine.generate(prompt, sampled, timeout=30)
    for k in (1, 3, 6):
        assert whole[:k] + engine.submit(prompt, replace(sampled, max_tokens=12 - k), generated=whole[:k]).result(30) \
            == whole, k
    with pytest.raises(InvalidRequestError, match="^the prompt is empty$"):  # found in review: an engine error
        engine.submit([], SamplingParams(max_tokens=2), generated=[1, 2])


def test_a_stage_runs_while_its_blocks_arrive_and_its_waits_have_deadlines(tmp_path):
    package = packages.tiny_package(tmp_path / "pkg", "llama", layers=4, layers_per_block=1, seed=3)
    agent = GatedAgent(package.path)
    engine = Engine(AgentBlockProvider(agent, package_id=None, where="gated agent", timeout_s=30)).start()
    try:
        head, tail = StageRunner(engine.model), StageRunner(engine.model)
        agent.release(0, 1)  # the head stage's blocks only: layers 0-1 with the embeddings
        out = head.run("s", range(0, 2), 0, tokens=[1, 2, 3], timeout=10)
        assert out.hidden.shape == (1, 3, 64) and not engine.model.fully_loaded
        with pytest.raises(TimeoutError, match="layer 2 not loaded within 0.2 s"):
            tail.run("s", range(2, 4), 0, hidden=out.hidden, timeout=0.2)
        assert tail.sessions == 0  # a failed call leaves no half-filled session behind
        # what a call reads, and a wait for it apart from the call (a serving worker waits before its turn)
        assert tail.parts(range(2, 4)) == [2, 3, HEAD] and tail.parts(range(0, 2)) == [EMBED, 0, 1]
        assert tail.parts(range(2, 4), norm_only=True)[-1] == FINAL_NORM and tail.parts(range(3, 9)) == []
        assert head.waiter(head.parts(range(0, 2))) is None
        with pytest.raises(TimeoutError, match="layer 2 not loaded within 0.2 s"):
            tail.waiter(tail.parts(range(2, 4)))(0.2)
        done = threading.Timer(0.3, agent.release)
        done.start()
        tail.waiter(tail.parts(range(2, 4)))(10)
        assert tail.waiter(tail.parts(range(2, 4))) is None
        assert tail.run("s", range(2, 4), 0, hidden=out.hidden, timeout=10).token is not None
        done.join()
    finally:
        engine.close()


def test_calls_that_do_not_fit_the_session_are_refused_naming_why(case):
    _, engine = case
    runner = StageRunner(engine.model, max_sessions=1)
    out = runner.run("s", range(0, 4), 0, tokens=[1, 2, 3], timeout=5)
    with pytest.raises(StageSessionError, match="session 's' is at position 3, the call is at 5"):
        runner.run("s", range(0, 4), 5, tokens=[4], timeout=5)
    with pytest.raises(StageSessionError, match="session 's' runs layers 0-3 here, the call asks for 0-1"):
        runner.run("s", range(0, 2), 3, tokens=[4], timeout=5)
    with pytest.raises(StageSessionError, match="session 'x' is not held here"):
        runner.run("x", range(4, 8), 3, hidden=out.hidden[:, -1:], timeout=5)
    with pytest.raises(StageSessionError, match="session 's' is open already"):
        runner.run("s", range(0, 4), 0, tokens=[1], timeout=5)
    with pytest.raises(StageCapacityError, match="already runs 1 pipelined sessions"):
        runner.run("t", range(0, 4), 0, tokens=[1], timeout=5)
    with pytest.raises(InvalidRequestError, match=r"hidden states must be \[1, positions, 64\], got \[3, 64\]"):
        runner.run("t", range(4, 8), 0, hidden=out.hidden[0], timeout=5)
    with pytest.raises(InvalidRequestError, match="the first stage takes token ids, the others hidden states"):
        runner.run("t", range(0, 4), 0, hidden=out.hidden, timeout=5)
    with pytest.raises(InvalidRequestError, match=r"\(layers 0-3 got neither\)$"):  # it said "hidden states"
        runner.run("t", range(0, 4), 0, timeout=5)
    with pytest.raises(InvalidRequestError, match="one token after it; got 2 positions at 3"):
        runner.run("s", range(0, 4), 3, tokens=[4, 5], timeout=5)
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        StageRunner(engine.model).run("v", range(0, 4), 0, tokens=[1, 9999], timeout=5)
    with pytest.raises(InvalidRequestError, match="positions 0-128 exceed the model's 128"):  # no unbounded cache
        StageRunner(engine.model).run("w", range(0, 4), 0, tokens=[1] * 129, timeout=5)
    assert runner.run("s", range(0, 4), 3, tokens=[4], timeout=5).hidden.shape[1] == 1


def test_idle_sessions_expire():
    clock = [0.0]
    model = SimpleNamespace(skeleton=SimpleNamespace(windows=(None,)))  # what opening a session reads
    runner = StageRunner(model=model, idle_s=10, clock=lambda: clock[0])
    runner._session("a", range(0, 1), 0, None)
    clock[0] = 5
    runner._session("b", range(0, 1), 0, None)
    clock[0] = 12
    assert runner.expire() == 1 and runner.sessions == 1


def test_a_session_whose_call_runs_long_is_not_expired_under_it():
    """A call waiting for its layers (a step timeout above the idle time) holds its session: expiring it
    then would fail the request's next token with "not held"."""
    clock = [0.0]
    model = SimpleNamespace(skeleton=SimpleNamespace(windows=(None,)))
    runner = StageRunner(model=model, idle_s=10, clock=lambda: clock[0])
    state = runner._session("a", range(0, 1), 0, None)
    clock[0] = 60
    with state.lock:  # as run() holds it for the call
        assert runner.expire() == 0 and runner.sessions == 1
    assert runner.expire() == 1 and runner.sessions == 0


def test_a_session_is_held_until_its_step_deadline_while_later_stages_compute_the_step(case):
    """The head (or a middle stage) waits for the later stages' answer within the step's deadline: its session
    is not idle then, even with a step timeout above the idle time."""
    _, engine = case
    clock = [0.0]
    runner = StageRunner(engine.model, idle_s=10, clock=lambda: clock[0])
    runner.run("s", range(0, 4), 0, tokens=[1, 2, 3], timeout=60)
    clock[0] = 30
    assert runner.expire() == 0 and runner.sessions == 1
    clock[0] = 71
    assert runner.expire() == 1 and runner.sessions == 0


def test_a_full_runner_makes_room_by_dropping_its_idle_sessions_first():
    clock = [0.0]
    model = SimpleNamespace(skeleton=SimpleNamespace(windows=(None,)))
    runner = StageRunner(model=model, idle_s=10, max_sessions=1, clock=lambda: clock[0])
    runner._session("a", range(0, 1), 0, None)
    with pytest.raises(StageCapacityError):
        runner._session("b", range(0, 1), 0, None)  # a is not idle yet
    clock[0] = 11
    runner._session("b", range(0, 1), 0, None)
    assert runner.sessions == 1
