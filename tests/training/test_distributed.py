"""torchrun on the CPU (gloo): DDP and FSDP2 train, shard the batches, report once, and resume.

The jobs name training.device cpu: on a machine with fewer GPUs than processes (one GPU, two
processes) a CUDA job is refused (a GPU per local rank); the CPU path must not touch the GPUs."""

import json
import os
import re
import signal
import subprocess
import sys

import pytest
import torch

from tests.torchrun import free_port, hasten_train


def _torchrun(tmp_path, name, training, *extra, nproc=2, settings=None):
    out, rows, _ = hasten_train({"model": {"default_size": "tiny"},
                                 "training": {"max_tokens": 256, "learning_rate": 0.003, "warmup_steps": 1,
                                              "logging_steps": 1, "device": "cpu", **training},
                                 "logging": {"tensorboard": "false"}, **(settings or {})},
                                tmp_path / name, *extra, nproc=nproc)
    return out, rows


@pytest.mark.parametrize("strategy,extra", [("ddp", {}), ("fsdp2", {}),
                                            ("fsdp2", {"fsdp2_reshard_after_forward": False})],
                         ids=["ddp", "fsdp2", "fsdp2-keep-gathered"])
def test_two_processes_train_and_report_once(tmp_path, strategy, extra):
    out, rows = _torchrun(tmp_path, strategy, {"distributed": strategy, "max_steps": 2,
                                               "checkpoint": {"interval_steps": 2}, **extra})
    assert [r["step"] for r in rows] == [2 - 1, 2]  # rank 0 alone writes, one row per step
    summary = json.loads((out / "logs" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["distributed"] == strategy
    assert summary["tokens"] == sum(r["tokens"] for r in rows) > 256  # both ranks' tokens
    assert (out / "checkpoints" / "checkpoint-000002" / "manifest.json").is_file()
    assert (out / "final" / "model.safetensors").is_file()


def test_fsdp2_layers_grouped_into_one_unit_train_like_one_per_layer(tmp_path):
    """training.fsdp2_layers_per_unit 2 (both tiny layers in one unit: one gather, one reduce) keeps
    the per-layer run's losses; a unit count that does not divide the layers is covered by 3."""
    training = {"distributed": "fsdp2", "max_steps": 3, "checkpoint": {"interval_steps": 3}}
    _, per_layer = _torchrun(tmp_path, "per_layer", {**training, "fsdp2_layers_per_unit": 1})
    for layers_per_unit in (2, 3):
        _, grouped = _torchrun(tmp_path, f"grouped{layers_per_unit}",
                               {**training, "fsdp2_layers_per_unit": layers_per_unit})
        for got, want in zip(grouped, per_layer, strict=True):
            assert got["loss"] == pytest.approx(want["loss"], abs=1e-5), layers_per_unit


def test_auto_fsdp2_units_group_small_layers_only():
    """auto: 50M parameters per unit: Qwen3-0.6B's 15.7M-parameter layers 4 to a unit, 7B-sized
    layers (200M+) one each, a model smaller than one unit in one unit; a number is taken as given."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from hasten.training.defaults import embedded_model_config
    from hasten.training.distributed import layers_per_fsdp2_unit

    with torch.device("meta"):
        small = list(Qwen3ForCausalLM(embedded_model_config("qwen3-0.6b")).model.layers)
        large = list(Qwen3ForCausalLM(Qwen3Config(hidden_size=4096, intermediate_size=12288, num_hidden_layers=2,
                                                  num_attention_heads=32, num_key_value_heads=8,
                                                  head_dim=128)).model.layers)
        tiny = list(Qwen3ForCausalLM(embedded_model_config("tiny")).model.layers)
    assert layers_per_fsdp2_unit(small, 0) == 4
    assert layers_per_fsdp2_unit(large, 0) == 1
    assert layers_per_fsdp2_unit(tiny, 0) == len(tiny) == 2
    assert layers_per_fsdp2_unit(small, 3) == 3


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_one_process_under_torchrun_runs_the_named_strategy(tmp_path, strategy):
    """torchrun --nproc_per_node 1 keeps the config's strategy (a group of one), so a multi-GPU
    config can be tried on one GPU; its losses are the plain run's."""
    out, rows = _torchrun(tmp_path, strategy, {"distributed": strategy, "max_steps": 2,
                                               "checkpoint": {"interval_steps": 2}}, nproc=1)
    summary = json.loads((out / "logs" / "summary.json").read_text())
    assert summary["world_size"] == 1 and summary["distributed"] == strategy
    assert (out / "checkpoints" / "checkpoint-000002" / "manifest.json").is_file()
    _, plain_rows = _torchrun(tmp_path, f"{strategy}-auto", {"distributed": "auto", "max_steps": 2,
                                                             "checkpoint": {"interval_steps": 2}}, nproc=1)
    plain_summary = json.loads((tmp_path / f"{strategy}-auto" / "logs" / "summary.json").read_text())
    assert plain_summary["distributed"] == "none"
    for got, want in zip(rows, plain_rows, strict=True):
        assert got["loss"] == pytest.approx(want["loss"], abs=1e-4)


def test_fsdp2_resume_continues_the_same_losses(tmp_path):
    straight, rows = _torchrun(tmp_path, "a", {"distributed": "fsdp2", "max_steps": 4,
                                               "checkpoint": {"interval_steps": 2}})
    want = {r["step"]: r["loss"] for r in rows}
    _, resumed_rows = _torchrun(tmp_path, "b", {"distributed": "fsdp2", "max_steps": 4,
                                                "checkpoint": {"interval_steps": 2}},
                                "--resume", str(straight / "checkpoints" / "checkpoint-000002"))
    got = {r["step"]: r["loss"] for r in resumed_rows}
    assert sorted(got) == [3, 4]
    for step in (3, 4):
        assert got[step] == pytest.approx(want[step], abs=1e-5), step


@pytest.mark.parametrize("quantize", ["none", "nf4"])
def test_fsdp2_lora_trains_like_ddp_shards_the_base_and_resumes(tmp_path, quantize):
    """LoRA (and QLoRA: an NF4 base stored in the training dtype's bytes, so FSDP2 can shard it)
    under FSDP2: each rank holds half the parameters, the losses and saved adapters are DDP's, the
    adapters are saved whole (gathered, not one rank's shard), and a resumed run repeats the
    straight run's last steps."""
    pytest.importorskip("peft")
    if quantize == "nf4":
        pytest.importorskip("bitsandbytes")
    from safetensors.torch import load_file
    from transformers import Qwen3ForCausalLM

    from hasten.data import ByteTokenizer
    from hasten.training.defaults import embedded_model_config

    folder = tmp_path / "model"
    torch.manual_seed(0)
    Qwen3ForCausalLM(embedded_model_config("tiny")).save_pretrained(folder)
    ByteTokenizer().save_pretrained(folder)
    settings = {"model": {"path": str(folder)},
                "lora": {"enabled": True, "r": 4, "quantize": quantize,
                         "target_modules": "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"}}
    training = {"max_steps": 4, "learning_rate": 0.01, "dtype": "bfloat16", "checkpoint": {"interval_steps": 2}}
    ddp, ddp_rows = _torchrun(tmp_path, "ddp", {**training, "distributed": "ddp"}, settings=settings)
    fsdp2, fsdp2_rows = _torchrun(tmp_path, "fsdp2", {**training, "distributed": "fsdp2"}, settings=settings)
    held = re.search(r"fsdp2 keeps ([\d.e-]+) MiB of the model's ([\d.e-]+) MiB", (fsdp2 / "stderr.txt").read_text())
    assert held and float(held[1]) < 0.55 * float(held[2]), held
    summary = json.loads((fsdp2 / "logs" / "summary.json").read_text())
    assert any(item.startswith("fused LoRA projections (") for item in summary["hasten_active"]), summary
    if quantize == "none":  # q/k/v and gate/up of a layer gather together in its FSDP2 unit
        assert any(item.startswith("grouped LoRA projections (10 layers") for item in summary["hasten_active"]), \
            summary
    assert [r["loss"] for r in fsdp2_rows] == pytest.approx([r["loss"] for r in ddp_rows], abs=1e-3)
    assert fsdp2_rows[-1]["loss"] < fsdp2_rows[0]["loss"]
    want, got = (load_file(run / "final" / "adapter_model.safetensors") for run in (ddp, fsdp2))
    assert sorted(got) == sorted(want) and len(got) == 2 * 7 * 2  # A and B, 7 projections, 2 layers
    for name, tensor in want.items():
        assert got[name].shape == tensor.shape, name
        torch.testing.assert_close(got[name], tensor, atol=2e-3, rtol=2e-2)
    # each strategy resumes its own checkpoint (the adapters loaded through the distributed
    # state-dict API: sharded under FSDP2, whole into each DDP replica)
    runs = [("fsdp2", fsdp2, fsdp2_rows)] + ([("ddp", ddp, ddp_rows)] if quantize == "none" else [])
    for strategy, run, straight in runs:
        _, resumed = _torchrun(tmp_path, f"resumed-{strategy}", {**training, "distributed": strategy}, "--resume",
                               str(run / "checkpoints" / "checkpoint-000002"), settings=settings)
        assert [r["step"] for r in resumed] == [3, 4]
        assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in straight[2:]], abs=1e-6), strategy


def test_elastic_restart_after_a_worker_dies_resumes_the_same_losses(tmp_path):
    """torchrun --max-restarts 1: one worker is SIGKILLed after the first checkpoint; the restarted
    workers resume from the newest checkpoint and finish on the uninterrupted run's losses."""
    import time

    training = {"distributed": "ddp", "max_steps": 40, "checkpoint": {"interval_steps": 3}}
    _, straight = _torchrun(tmp_path, "straight", training)
    want = {r["step"]: r["loss"] for r in straight}
    config = tmp_path / "elastic.yaml"
    config.write_text(json.dumps({"model": {"default_size": "tiny"},
                                  "training": {"max_tokens": 256, "learning_rate": 0.003, "warmup_steps": 1,
                                               "logging_steps": 1, "device": "cpu", **training},
                                  "logging": {"tensorboard": "false"}}))
    out = tmp_path / "elastic"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "--max-restarts", "1", "-m", "hasten", "train", "--config", str(config), "--output_dir", str(out),
           "--resume", "auto", "--no_progress"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not list(out.glob("checkpoints/*/manifest.json")):
            assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint before the job ended"
            time.sleep(0.05)
        workers = subprocess.run(["pgrep", "-f", f"output_dir {out}"], capture_output=True, text=True).stdout.split()
        victim = max(int(pid) for pid in workers if int(pid) != proc.pid)  # the launcher starts the workers last
        os.kill(victim, signal.SIGKILL)
        _, err = proc.communicate(timeout=300)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    assert proc.returncode == 0, err[-3000:]
    # it did die and come back: only a restarted worker resumes (the first attempt began in an empty
    # folder). torchrun's "closing signal" line is not required: when the killed worker's peer fails
    # on its own before torchrun's next poll, torchrun has no live process to signal (seen once in CI)
    assert "resumed from" in err, err[-3000:]
    rows = [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    got = {r["step"]: r["loss"] for r in rows}  # steps trained twice: the restart's value wins
    assert sorted(got) == sorted(want)
    for step in want:
        assert got[step] == pytest.approx(want[step], abs=1e-4), step


def test_each_elastic_restart_gets_its_own_store_keys():
    """A restarted attempt must not read the keys (NCCL unique id) the dead attempt left in the agent store."""
    from datetime import timedelta

    import torch.distributed as dist

    from hasten.training.distributed import restart_scoped_store

    port = free_port()
    agent = dist.TCPStore("127.0.0.1", port, 1, is_master=True, timeout=timedelta(seconds=10))
    env = {"TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    first = restart_scoped_store(env | {"TORCHELASTIC_RESTART_COUNT": "0"}, 1, timedelta(seconds=10))
    first.set("default_pg/0", b"unique id of attempt 0")
    second = restart_scoped_store(env | {"TORCHELASTIC_RESTART_COUNT": "1"}, 1, timedelta(seconds=10))
    assert second.check(["default_pg/0"]) is False
    second.set("default_pg/0", b"unique id of attempt 1")
    assert first.get("default_pg/0") == b"unique id of attempt 0"
    assert agent.get("hasten/attempt_1/default_pg/0") == b"unique id of attempt 1"
    assert restart_scoped_store({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}, 1) is None


def test_gradient_accumulation_reduces_once_per_step_and_trains_like_ddp(tmp_path):
    """FSDP2 keeps the first micro-batch's gradients local and reduces on the last; DDP does the
    same through no_sync. Both must end on the same weights: a dropped or doubled micro-batch
    gradient on either side would move them apart."""
    from safetensors.torch import load_file

    runs = {}
    for strategy in ("ddp", "fsdp2"):
        out, rows = _torchrun(tmp_path, strategy, {"distributed": strategy, "max_steps": 3,
                                                   "gradient_accumulation_steps": 2})
        runs[strategy] = (rows, load_file(str(out / "final" / "model.safetensors")))
    (ddp_rows, ddp_weights), (fsdp_rows, fsdp_weights) = runs["ddp"], runs["fsdp2"]
    assert [r["step"] for r in fsdp_rows] == [1, 2, 3]
    for a, b in zip(ddp_rows, fsdp_rows):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)
    assert ddp_weights.keys() == fsdp_weights.keys()
    for name, weight in ddp_weights.items():
        assert torch.allclose(weight.float(), fsdp_weights[name].float(), rtol=1e-4, atol=1e-5), name


def test_more_local_ranks_than_gpus_is_a_config_error_and_the_cpu_path_uses_no_gpu(monkeypatch):
    """torchrun --nproc_per_node 2 on a one-GPU machine: a CUDA run is refused naming both numbers
    and the fixes (it died with "CUDA error: invalid device ordinal"); --device cpu joins over gloo
    without selecting a GPU (here a group of one: rank 0 of 1, local rank 1)."""
    import torch.distributed as dist

    from hasten.config import ConfigError
    from hasten.training.distributed import from_environment, shutdown

    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda *a: pytest.fail("set_device on the CPU path"))
    with pytest.raises(ConfigError, match=r"2 processes.*local rank 1.*1 CUDA GPU\(s\).*--nproc_per_node 1.*"
                                          r"--device cpu"):
        from_environment("ddp", "cuda")
    assert not dist.is_initialized()
    ctx = from_environment("ddp", "cpu")
    try:
        assert dist.get_backend() == "gloo" and ctx.strategy == "ddp" and ctx.local_rank == 1
    finally:
        shutdown(ctx)
