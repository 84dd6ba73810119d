"""training.cuda_graphs: the config key, the CPU fallback (said once, the same run as eager), and
GraphedAdamW's bookkeeping (warm-up, capture, replay, resume, invalidation) against a stand-in for
CUDA graphs that runs on the CPU. The real capture is tested in tests/gpu/test_cuda_graphs_cuda.py."""

import contextlib
import json

import pytest
import torch

from hasten.config import Config, ConfigError
from hasten.observability import fallback_counts, fallback_reasons
from hasten.training import graphed_optimizer as go
from hasten.training import loop
from hasten.training.graphed_optimizer import FALLBACK, GraphedAdamW, build_adamw

TINY = {"model": {"default_size": "tiny"},
        "training": {"max_tokens": 384, "max_steps": 5, "learning_rate": 0.003, "warmup_steps": 2,
                     "logging_steps": 1, "gradient_accumulation_steps": 2,
                     "checkpoint": {"interval_steps": 2, "keep_last": 2}}}


# --- the config key ------------------------------------------------------------------------------

def test_cuda_graphs_defaults_to_false_and_takes_yaml_false_and_optimizer(tmp_path):
    assert Config().training.cuda_graphs == "false"
    path = tmp_path / "c.yaml"
    path.write_text("training:\n  cuda_graphs: false\n")
    assert Config.from_yaml(path).training.cuda_graphs == "false"
    path.write_text("training:\n  cuda_graphs: optimizer\n")
    assert Config.from_yaml(path).training.cuda_graphs == "optimizer"


@pytest.mark.parametrize("value", [True, "true", "full", "Optimizer", 1, None])
def test_cuda_graphs_refuses_other_values_naming_the_choices(value):
    with pytest.raises(ConfigError, match=r"`training.cuda_graphs` must be one of 'false', 'optimizer', 'step'"):
        Config.from_dict({"training": {"cuda_graphs": value}})


def test_cuda_graphs_typo_names_the_key():
    with pytest.raises(ConfigError, match=r"unknown key `training.cuda_graph`; did you mean `training.cuda_graphs`"):
        Config.from_dict({"training": {"cuda_graph": "optimizer"}})


def test_cuda_graphs_is_in_the_configuration_reference():
    from hasten.config_docs import leaf_keys, render_config_reference

    assert "training.cuda_graphs" in leaf_keys()
    assert '| `training.cuda_graphs` | one of `"false"`, `"optimizer"`, `"step"` | `"false"` |' in render_config_reference()


# --- the CPU fallback ----------------------------------------------------------------------------

def _params(seed=0, shapes=((4, 3), (5,), (2, 2, 2))):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=gen)) for s in shapes]


def test_build_adamw_on_cpu_falls_back_to_the_eager_optimizer_and_says_why():
    params = _params()
    opt = build_adamw(params, lr=1e-3, weight_decay=0.1, device=torch.device("cpu"), cuda_graphs="optimizer")
    assert type(opt) is torch.optim.AdamW and not opt.defaults["fused"]
    assert fallback_counts() == {FALLBACK: 1}
    assert "trains on cpu" in fallback_reasons()[FALLBACK] and "runs eagerly" in fallback_reasons()[FALLBACK]
    plain = build_adamw(_params(), lr=1e-3, weight_decay=0.1, device=torch.device("cpu"))
    assert type(plain) is torch.optim.AdamW and fallback_counts() == {FALLBACK: 1}  # false says nothing


def test_build_adamw_refuses_fsdp2_loudly(monkeypatch):
    monkeypatch.setattr(torch.optim.AdamW, "__init__", lambda self, params, **kw: None)  # no CUDA tensors here
    build_adamw(_params(), lr=1e-3, weight_decay=0.0, device=torch.device("cuda", 0), cuda_graphs="optimizer",
                distributed="fsdp2")
    assert "FSDP2" in fallback_reasons()[FALLBACK]


def test_graphed_adamw_on_cpu_is_disabled_with_the_reason_and_steps_like_adamw():
    params, ref = _params(), _params()
    opt, want = GraphedAdamW(params, lr=0.01, weight_decay=0.1), torch.optim.AdamW(ref, lr=0.01, weight_decay=0.1)
    assert opt.disabled_reason == "the parameters are on cpu, not on one CUDA device"
    assert "not on one CUDA device" in fallback_reasons()[FALLBACK]
    for step in range(3):
        for p, q in zip(params, ref):
            p.grad = torch.full_like(p, 0.1 * (step + 1))
            q.grad = p.grad.clone()
        opt.step()
        want.step()
        opt.zero_grad()
        want.zero_grad()
    assert all(p.grad is None for p in params)  # disabled: set_to_none honoured as in torch
    for p, q in zip(params, ref):
        assert torch.equal(p, q)
    assert opt.eager_steps == 3 and opt.captures == 0 and not opt.captured


def _weights(folder):
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def test_cpu_run_with_cuda_graphs_optimizer_equals_the_eager_run_exactly(tmp_path):
    eager = loop.train(Config.from_dict(TINY), tmp_path / "a", tmp_path / "a" / "logs", progress=False)
    raw = json.loads(json.dumps(TINY))
    raw["training"]["cuda_graphs"] = "optimizer"
    graphed = loop.train(Config.from_dict(raw), tmp_path / "b", tmp_path / "b" / "logs", progress=False)
    assert graphed.losses == eager.losses  # exactly: the same optimizer runs
    a, b = _weights(eager.model_dir), _weights(graphed.model_dir)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    summary = json.loads((tmp_path / "b" / "logs" / "summary.json").read_text())
    assert "trains on cpu" in summary["fallback_reasons"][FALLBACK]
    assert summary["fallbacks"][FALLBACK] == 1 and summary["optimizer_graph"] is None
    # resuming a cuda_graphs run with the key changed is allowed (it changes how the step runs, not what)
    raw["training"]["cuda_graphs"] = "false"
    raw["training"]["max_steps"] = 6
    resumed = loop.train(Config.from_dict(raw), tmp_path / "b", tmp_path / "b" / "logs", progress=False, resume="auto")
    assert resumed.steps == 6


# --- GraphedAdamW's bookkeeping, with a stand-in for CUDA graphs on the CPU ------------------------

class _FakeStream:
    def __init__(self, device=None):
        self.waits = 0

    def wait_stream(self, other):
        self.waits += 1


class _FakeGraph:
    """Capture records nothing and runs nothing (the step runs, then every tensor it wrote is put
    back); replay runs the optimizer's step again with the learning rate read from its tensors and
    the hyperparameters of capture time, as the CUDA graph would."""

    owner = None
    fail_with: Exception | None = None

    def __init__(self):
        self.owner = _FakeGraph.owner
        self.hyper = None

    def replay(self):
        opt = self.owner
        saved = [g["lr"] for g in opt.param_groups]
        for g, lr in zip(opt.param_groups, opt._lr_tensors):
            g["lr"] = float(lr)  # what the graph reads at replay
        try:
            opt._run_step()
        finally:
            for g, lr in zip(opt.param_groups, saved):
                g["lr"] = lr


@contextlib.contextmanager
def _fake_capture(graph, stream=None, capture_error_mode="global"):
    opt = graph.owner
    assert stream is opt._stream and capture_error_mode == "thread_local"
    assert all(g["capturable"] and isinstance(g["lr"], torch.Tensor) for g in opt.param_groups)
    if _FakeGraph.fail_with is not None:
        raise _FakeGraph.fail_with
    tensors = [p for g in opt.param_groups for p in g["params"]]
    tensors += [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    before = [t.detach().clone() for t in tensors]
    yield
    with torch.no_grad():
        for t, old in zip(tensors, before):
            t.copy_(old)


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(go, "_one_cuda_device", lambda devices: torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "Stream", _FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "graph", _fake_capture)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    _FakeGraph.fail_with = None

    def make(params, **kwargs):
        opt = GraphedAdamW(params, **kwargs)
        _FakeGraph.owner = opt
        return opt

    yield make
    _FakeGraph.owner = None


LRS = [2.0 ** -7, 3 * 2.0 ** -9, 2.0 ** -8, 5 * 2.0 ** -11, 2.0 ** -10, 3 * 2.0 ** -12, 2.0 ** -11, 2.0 ** -12]
# float32 numbers: the graph's float32 rate and the eager step's double are the same number


def _grads(step, params, micro):
    gen = torch.Generator().manual_seed(100 * step + micro)
    return [torch.randn(p.shape, generator=gen) for p in params]


def _train(opt, params, steps, first=0, skip_grad=None):
    """`steps` optimizer steps with 2 accumulated backward passes each, the LR changing every step;
    `skip_grad` (step, index): that parameter gets no gradient in that step (its grad set to None)."""
    for step in range(first, first + steps):
        for group in opt.param_groups:
            group["lr"] = LRS[step]
        for micro in range(2):
            for p, g in zip(params, _grads(step, params, micro)):
                p.grad = g.clone() if p.grad is None else p.grad.add_(g)  # in place, as backward accumulates
        if skip_grad is not None and skip_grad[0] == step:
            params[skip_grad[1]].grad = None
        opt.step()
        opt.zero_grad(set_to_none=True)


def test_warmup_then_capture_then_replay_equals_eager_adamw(fake_cuda):
    params, ref = _params(), _params()
    opt = fake_cuda(params, lr=LRS[0], weight_decay=0.1, warmup_steps=2)
    want = torch.optim.AdamW(ref, lr=LRS[0], weight_decay=0.1, fused=True)
    _train(opt, params, 7)
    _train(want, ref, 7)
    for p, q in zip(params, ref):
        assert torch.equal(p, q)
    assert (opt.eager_steps, opt.captures, opt.replays) == (2, 1, 5)  # the capturing step replays once
    assert opt.captured and opt.disabled_reason is None and not fallback_counts()
    # outside capture param_groups look like the eager optimizer's: float lr, capturable False
    assert all(isinstance(g["lr"], float) and g["capturable"] is False for g in opt.param_groups)
    grads = [p.grad for p in params]
    assert all(g is not None and not g.any() for g in grads)  # zeroed in place, never dropped
    assert opt._stream.waits == 2  # each warm-up step waited for the main stream's work


def test_state_dict_resumes_identically_in_either_optimizer(fake_cuda):
    ref = _params()
    want = torch.optim.AdamW(ref, lr=LRS[0], weight_decay=0.1, fused=True)
    _train(want, ref, 8)

    # graphed for 5 steps, saved, resumed in a new graphed optimizer: warms up and captures again
    params = _params()
    first = fake_cuda(params, lr=LRS[0], weight_decay=0.1)
    _train(first, params, 5)
    saved = first.state_dict()
    assert all(isinstance(g["lr"], float) and not g["capturable"] for g in saved["param_groups"])
    second = fake_cuda(params, lr=LRS[0], weight_decay=0.1)
    second.load_state_dict(saved)
    _train(second, params, 3, first=5)
    assert (second.eager_steps, second.captures, second.replays) == (2, 1, 1)
    for p, q in zip(params, ref):
        assert torch.equal(p, q)

    # an eager optimizer's checkpoint into a graphed one, and back
    params = _params()
    eager = torch.optim.AdamW(params, lr=LRS[0], weight_decay=0.1, fused=True)
    _train(eager, params, 3)
    graphed = fake_cuda(params, lr=LRS[0], weight_decay=0.1)
    graphed.load_state_dict(eager.state_dict())
    _train(graphed, params, 3, first=3)
    back = torch.optim.AdamW(params, lr=LRS[0], weight_decay=0.1, fused=True)
    back.load_state_dict(graphed.state_dict())
    _train(back, params, 2, first=6)
    for p, q in zip(params, ref):
        assert torch.equal(p, q)


def test_load_state_dict_drops_the_graph(fake_cuda):
    params = _params()
    opt = fake_cuda(params, lr=LRS[0])
    _train(opt, params, 4)
    assert opt.captured
    opt.load_state_dict(opt.state_dict())
    assert not opt.captured
    _train(opt, params, 3, first=4)
    assert opt.captures == 2 and opt.eager_steps == 4


def test_a_gradient_set_to_none_after_capture_runs_that_step_eagerly(fake_cuda):
    params, ref = _params(), _params()
    opt = fake_cuda(params, lr=LRS[0])
    want = torch.optim.AdamW(ref, lr=LRS[0], fused=True)
    _train(opt, params, 6, skip_grad=(4, 1))
    _train(want, ref, 6, skip_grad=(4, 1))
    for p, q in zip(params, ref):
        assert torch.equal(p, q)
    assert opt.eager_steps == 3 and opt.replays == 3 and opt.captures == 1
    assert "no gradient" in fallback_reasons()[FALLBACK]


def test_a_replaced_gradient_is_copied_into_the_captured_one(fake_cuda):
    params, ref = _params(), _params()
    opt = fake_cuda(params, lr=LRS[0])
    want = torch.optim.AdamW(ref, lr=LRS[0], fused=True)
    _train(opt, params, 3)
    _train(want, ref, 3)
    static = params[0].grad
    for p, q in zip(params, ref):
        p.grad = torch.ones_like(p) * 0.5  # new tensors, not the ones the graph reads
        q.grad = torch.ones_like(q) * 0.5
    opt.step()
    want.step()
    assert params[0].grad is static and opt.replays == 2
    for p, q in zip(params, ref):
        assert torch.equal(p, q)


def test_a_changed_hyperparameter_or_new_gradient_captures_again(fake_cuda):
    params, ref = _params(), _params()
    opt = fake_cuda(params, lr=LRS[0], weight_decay=0.1)
    want = torch.optim.AdamW(ref, lr=LRS[0], weight_decay=0.1, fused=True)
    _train(opt, params, 4)
    _train(want, ref, 4)
    for g in opt.param_groups + want.param_groups:
        g["weight_decay"] = 0.3
    _train(opt, params, 2, first=4)
    _train(want, ref, 2, first=4)
    for p, q in zip(params, ref):
        assert torch.equal(p, q)
    assert opt.captures == 2


def test_a_parameter_without_gradient_at_capture_time_is_left_out_until_it_gets_one(fake_cuda):
    params, ref = _params(), _params()
    opt = fake_cuda(params, lr=LRS[0])
    want = torch.optim.AdamW(ref, lr=LRS[0], fused=True)
    for opt_, ps in ((opt, params), (want, ref)):
        for step in range(6):
            for group in opt_.param_groups:
                group["lr"] = LRS[step]
            for i, (p, g) in enumerate(zip(ps, _grads(step, ps, 0))):
                if i != 2 or step >= 4:  # parameter 2 gets gradients from step 4 on
                    p.grad = g.clone() if p.grad is None else p.grad.add_(g)
            opt_.step()
            opt_.zero_grad(set_to_none=True)
    for p, q in zip(params, ref):
        assert torch.equal(p, q)
    # captured at step 3 without parameter 2; its first gradient (step 4) has no state yet: one
    # eager step creates it, and step 5 captures again with it
    assert opt.captures == 2 and opt.eager_steps == 3


def test_a_failed_capture_is_said_once_and_the_step_runs_eagerly(fake_cuda):
    params, ref = _params(), _params()
    _FakeGraph.fail_with = RuntimeError("operation not permitted when stream is capturing")
    opt = fake_cuda(params, lr=LRS[0], weight_decay=0.1)
    want = torch.optim.AdamW(ref, lr=LRS[0], weight_decay=0.1, fused=True)
    _train(opt, params, 5)
    _train(want, ref, 5)
    for p, q in zip(params, ref):
        assert torch.equal(p, q)
    assert fallback_counts() == {FALLBACK: 1}
    assert "operation not permitted when stream is capturing" in fallback_reasons()[FALLBACK]
    assert opt.disabled_reason and not opt.captured and opt.eager_steps == 5
    assert all(isinstance(g["lr"], float) and g["capturable"] is False for g in opt.param_groups)
    assert all(p.grad is None for p in params)  # from then on zero_grad is torch's own


def test_graphed_adamw_refuses_arguments_it_manages():
    with pytest.raises(TypeError, match="learning rate as a float"):
        GraphedAdamW(_params(), lr=torch.tensor(0.1))
    with pytest.raises(ValueError, match="capturable=True"):
        GraphedAdamW(_params(), capturable=True)
    with pytest.raises(ValueError, match="warmup_steps must be at least 1"):
        GraphedAdamW(_params(), warmup_steps=0)
