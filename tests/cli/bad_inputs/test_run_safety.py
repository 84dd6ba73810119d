"""Bad inputs around a run's own files (issue 15): a folder that holds another run, broken or
stale checkpoints, a full disk, a resume with another config, a diverging loss, data with nothing
to learn from, LoRA targets that do not exist, more processes than GPUs. Each case exits 2 with a
message that names the problem and the fix, and loses or changes no earlier file (or, where the
run is meant to go on, shows that it did the right thing)."""

from __future__ import annotations

import copy
import errno
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from hasten.training.checkpoint import latest_valid, verify
from .harness import TINY, run_train, snapshot

BASE = yaml.safe_load(TINY)
BASE["logging"]["tensorboard"] = "false"


def job(training: dict | None = None, **sections: dict) -> str:
    """TINY with training keys (checkpoint: {...} merges) and whole sections replaced or added."""
    config = copy.deepcopy(BASE)
    for key, value in (training or {}).items():
        if isinstance(value, dict):
            config["training"].setdefault(key, {}).update(value)
        else:
            config["training"][key] = value
    for name, section in sections.items():
        config.setdefault(name, {}).update(section)
    return yaml.safe_dump(config)


@pytest.fixture(autouse=True)
def _info_logs(caplog):
    """hasten's info lines (resumed from, removed, ...) reach stderr as under the CLI (pytest's root
    handler otherwise leaves the level at WARNING)."""
    caplog.set_level(logging.INFO, logger="hasten")


CHECKPOINTED = job({"checkpoint": {"interval_steps": 1}})


def _rows(root: Path) -> list[dict]:
    return [json.loads(line) for line in (root / "out" / "logs" / "metrics.jsonl").read_text().splitlines()]


def _finished(capsys, root: Path, config: str = CHECKPOINTED) -> Path:
    """A finished 2-step run in root/out with checkpoints 1 and 2; returns its checkpoints folder."""
    done = run_train(capsys, root, config=config)
    assert done.rc == 0, done.err
    return root / "out" / "checkpoints"


def _other_config(root: Path, text: str, name: str = "changed.yaml") -> str:
    path = root / name
    path.write_text(text)
    return str(path)


# --- a folder that holds an earlier run --------------------------------------------------------

def test_rerun_into_a_finished_folder_is_refused(capsys, tmp_path):
    _finished(capsys, tmp_path)
    again = run_train(capsys, tmp_path)
    again.assert_refused(str(tmp_path / "out"), "already holds", "final model", "metrics.jsonl: 2 rows",
                         "--resume auto", "--overwrite")


def test_rerun_into_a_finished_folder_without_checkpoints_is_refused(capsys, tmp_path):
    run_train(capsys, tmp_path, config=job())  # interval 100: a final model and logs, no checkpoint
    assert not (tmp_path / "out" / "checkpoints").exists()
    again = run_train(capsys, tmp_path)
    again.assert_refused("the results of an earlier run", "summary", "2 steps, finished", "--overwrite")


def test_overwrite_replaces_the_earlier_run_and_says_so(capsys, tmp_path):
    _finished(capsys, tmp_path)
    (tmp_path / "out" / "notes.txt").write_text("the user's own file")
    replaced = run_train(capsys, tmp_path, "--overwrite", "--max_steps", "1", keep=tmp_path / "nothing")
    assert replaced.rc == 0, replaced.err
    assert "--overwrite: deleted the earlier run's" in replaced.err and "checkpoints" in replaced.err
    assert [r["step"] for r in _rows(tmp_path)] == [1]  # not appended to the old rows
    assert sorted(p.name for p in (tmp_path / "out" / "checkpoints").iterdir()) == ["checkpoint-000001"]
    assert (tmp_path / "out" / "notes.txt").read_text() == "the user's own file"  # only hasten's files go


def test_overwrite_and_resume_together_are_refused(capsys, tmp_path):
    _finished(capsys, tmp_path)
    run_train(capsys, tmp_path, "--overwrite", "--resume", "auto").assert_refused("--overwrite", "pass one of them")


def test_resume_auto_continues_a_finished_run_with_more_steps(capsys, tmp_path):
    checkpoints = _finished(capsys, tmp_path)
    kept = snapshot(checkpoints / "checkpoint-000002")
    more = run_train(capsys, tmp_path, "--resume", "auto", "--max_steps", "4", keep=tmp_path / "nothing")
    assert more.rc == 0, more.err
    assert "resumed from" in more.err and "checkpoint-000002" in more.err and "appending to" in more.err
    assert [r["step"] for r in _rows(tmp_path)] == [1, 2, 3, 4]
    assert json.loads((tmp_path / "out" / "logs" / "summary.json").read_text())["steps"] == 4
    assert snapshot(checkpoints / "checkpoint-000002") == kept


def test_resume_auto_of_a_finished_run_changes_nothing(capsys, tmp_path):
    _finished(capsys, tmp_path)
    same = run_train(capsys, tmp_path, "--resume", "auto")
    assert same.rc == 0, same.err
    assert "finished at step 2" in same.err and "nothing was trained or changed" in same.err
    assert "raise --max_steps" in same.err
    same.assert_nothing_lost()


def test_resume_auto_of_a_run_finished_after_its_last_checkpoint_changes_nothing(capsys, tmp_path):
    _finished(capsys, tmp_path, job({"max_steps": 3, "checkpoint": {"interval_steps": 2}}))  # checkpoint 2, final 3
    same = run_train(capsys, tmp_path, "--resume", "auto")
    assert same.rc == 0, same.err
    assert "finished at step 3" in same.err
    same.assert_nothing_lost()


def test_separate_log_dir_with_rows_of_an_earlier_run_is_refused(capsys, tmp_path):
    logs = tmp_path / "shared-logs"
    logs.mkdir()
    (logs / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    run_train(capsys, tmp_path, "--log_dir", str(logs)).assert_refused("metrics.jsonl: 1 rows", "--overwrite")


# --- broken, partial and stale checkpoints ------------------------------------------------------

def test_truncated_newest_checkpoint_is_skipped_by_resume_auto(capsys, tmp_path):
    checkpoints = _finished(capsys, tmp_path)
    weights = checkpoints / "checkpoint-000002" / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    more = run_train(capsys, tmp_path, "--resume", "auto", "--max_steps", "3", keep=tmp_path / "nothing")
    assert more.rc == 0, more.err
    assert "skipping checkpoint" in more.err and "truncated" in more.err
    assert "resumed from" in more.err and "checkpoint-000001 at step 1" in more.err


def test_resume_from_a_truncated_checkpoint_is_refused(capsys, tmp_path):
    checkpoints = _finished(capsys, tmp_path)
    weights = checkpoints / "checkpoint-000002" / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    run_train(capsys, tmp_path, "--resume", str(checkpoints / "checkpoint-000002")).assert_refused(
        "checkpoint-000002", "truncated", "--resume auto")


def test_resume_from_a_checkpoint_with_a_bad_checksum_is_refused(capsys, tmp_path):
    checkpoints = _finished(capsys, tmp_path)
    optimizer = checkpoints / "checkpoint-000002" / "optimizer.pt"
    data = bytearray(optimizer.read_bytes())
    data[len(data) // 2] ^= 0xFF
    optimizer.write_bytes(bytes(data))
    run_train(capsys, tmp_path, "--resume", str(checkpoints / "checkpoint-000002")).assert_refused(
        "optimizer.pt does not match its checksum", "another checkpoint folder")


def test_resume_from_a_checkpoint_without_manifest_is_refused(capsys, tmp_path):
    checkpoints = _finished(capsys, tmp_path)
    (checkpoints / "checkpoint-000002" / "manifest.json").unlink()
    run_train(capsys, tmp_path, "--resume", str(checkpoints / "checkpoint-000002")).assert_refused(
        "no manifest.json", "not finished", "--resume auto")


def test_resume_auto_with_only_broken_checkpoints_is_refused(capsys, tmp_path):
    checkpoints = _finished(capsys, tmp_path)
    for folder in checkpoints.iterdir():
        (folder / "manifest.json").unlink()
    run_train(capsys, tmp_path, "--resume", "auto").assert_refused(
        "no complete checkpoint", "2 there, none complete", "--overwrite")


def test_stale_temporary_checkpoint_folder_is_removed_at_start(capsys, tmp_path):
    checkpoints = _finished(capsys, tmp_path)
    stale = checkpoints / ".tmp-checkpoint-000003-4242"
    (stale / "model").mkdir(parents=True)
    (stale / "model" / "model.safetensors").write_bytes(b"\0" * 4096)
    more = run_train(capsys, tmp_path, "--resume", "auto", "--max_steps", "3", keep=checkpoints / "checkpoint-000002")
    assert more.rc == 0, more.err
    assert f"removed {stale}" in more.err and "never finished" in more.err
    assert not stale.exists()
    more.assert_nothing_lost()  # the good checkpoint it resumed from is untouched


def test_keep_last_1_never_deletes_the_newest_good_checkpoint(capsys, tmp_path):
    """A broken checkpoint of a later step (left by an earlier run) must not make rotation delete
    the good one: before, keep_last 1 kept only the broken one, and a kill restarted from step 0."""
    config = job({"checkpoint": {"interval_steps": 1, "keep_last": 1}})
    checkpoints = _finished(capsys, tmp_path, config)
    assert sorted(p.name for p in checkpoints.iterdir()) == ["checkpoint-000002"]
    broken = checkpoints / "checkpoint-000009"
    shutil.copytree(checkpoints / "checkpoint-000002", broken)
    weights = broken / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    before = snapshot(broken)
    more = run_train(capsys, tmp_path, "--resume", "auto", "--max_steps", "3", keep=tmp_path / "nothing")
    assert more.rc == 0, more.err
    assert latest_valid(checkpoints) == checkpoints / "checkpoint-000003"  # a kill now resumes from step 3
    assert sorted(p.name for p in checkpoints.iterdir()) == ["checkpoint-000003", "checkpoint-000009"]
    assert snapshot(broken) == before  # not this run's to judge: left as it was


# --- a full disk ----------------------------------------------------------------------------------

def _disk_full_at(monkeypatch, step: int, err: int = errno.ENOSPC):
    """torch.save writes part of checkpoint-<step>'s optimizer.pt, then fails as a full disk does."""
    real = torch.save

    def save(obj, f, *args, **kwargs):
        if f"checkpoint-{step:06d}" in str(f) and str(f).endswith("optimizer.pt"):
            Path(f).write_bytes(b"\0" * 1000)
            raise OSError(err, "No space left on device" if err == errno.ENOSPC else "Input/output error", str(f))
        return real(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)


def test_full_disk_while_checkpointing_is_a_clear_error(capsys, tmp_path, monkeypatch):
    _disk_full_at(monkeypatch, 2)
    failed = run_train(capsys, tmp_path, config=CHECKPOINTED)
    failed.assert_refused("cannot write checkpoint", "checkpoint-000002", "no space left on device", "bytes",
                          "free there", "checkpoint-000001 is intact", "free disk space", "--resume auto")
    checkpoints = tmp_path / "out" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["checkpoint-000001"]  # no partial folder
    verify(checkpoints / "checkpoint-000001")
    monkeypatch.undo()
    finished = run_train(capsys, tmp_path, "--resume", "auto", keep=tmp_path / "nothing")  # the fix works
    assert finished.rc == 0, finished.err
    assert "checkpoint-000001 at step 1" in finished.err


def test_full_disk_leaves_the_earlier_checkpoints_untouched(capsys, tmp_path, monkeypatch):
    checkpoints = _finished(capsys, tmp_path)
    _disk_full_at(monkeypatch, 3)
    failed = run_train(capsys, tmp_path, "--resume", "auto", "--max_steps", "4", keep=checkpoints)
    failed.assert_refused("checkpoint-000003", "no space left", "checkpoint-000002 is intact")
    assert not list(checkpoints.glob(".tmp-*"))


def test_any_write_error_while_checkpointing_is_a_clear_error(capsys, tmp_path, monkeypatch):
    _disk_full_at(monkeypatch, 1, errno.EIO)
    failed = run_train(capsys, tmp_path, config=CHECKPOINTED)
    failed.assert_refused("cannot write checkpoint", "input/output error", "no earlier checkpoint exists",
                          "choose another --output_dir")


def test_full_disk_while_writing_the_final_model(capsys, tmp_path, monkeypatch):
    import hasten.training.loop as loop

    def save_final_model(model, hf_model, folder, ctx=None):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "model.safetensors").write_bytes(b"\0" * 100)
        raise OSError(errno.ENOSPC, "No space left on device", str(folder / "model.safetensors"))

    monkeypatch.setattr(loop, "save_final_model", save_final_model)
    failed = run_train(capsys, tmp_path, config=CHECKPOINTED)
    failed.assert_refused("cannot write the final model", "no space left", "checkpoint-000002 is intact",
                          "--resume auto")
    assert not (tmp_path / "out" / "final").exists() and not list((tmp_path / "out").glob(".tmp-final-*"))
    monkeypatch.undo()
    finished = run_train(capsys, tmp_path, "--resume", "auto", keep=tmp_path / "out" / "checkpoints")
    assert finished.rc == 0, finished.err
    assert (tmp_path / "out" / "final" / "model.safetensors").is_file()
    finished.assert_nothing_lost()


# --- resume with another config -------------------------------------------------------------------

def test_resume_with_another_learning_rate_is_refused(capsys, tmp_path):
    checkpoints = _finished(capsys, tmp_path)
    changed = _other_config(tmp_path, job({"learning_rate": 0.01, "checkpoint": {"interval_steps": 1}}))
    out = run_train(capsys, tmp_path, "--config", changed, "--resume", "auto", "--max_steps", "3", config=None)
    out.assert_refused("training.learning_rate: 0.003 in the checkpoint, 0.01 now",
                       "--allow_config_change training.learning_rate", str(checkpoints / "checkpoint-000002"))


def test_resume_with_another_learning_rate_when_allowed(capsys, tmp_path):
    _finished(capsys, tmp_path)
    changed = _other_config(tmp_path, job({"learning_rate": 0.001, "checkpoint": {"interval_steps": 1}}))
    out = run_train(capsys, tmp_path, "--config", changed, "--resume", "auto", "--max_steps", "3",
                    "--allow_config_change", "training.learning_rate", config=None, keep=tmp_path / "nothing")
    assert out.rc == 0, out.err
    assert "resuming with training.learning_rate 0.001 (the checkpoint had 0.003)" in out.err


def test_resume_with_another_max_tokens_is_refused(capsys, tmp_path):
    _finished(capsys, tmp_path)
    changed = _other_config(tmp_path, job({"max_tokens": 256, "checkpoint": {"interval_steps": 1}}))
    run_train(capsys, tmp_path, "--config", changed, "--resume", "auto", "--max_steps", "3", config=None
              ).assert_refused("training.max_tokens: 512 in the checkpoint, 256 now", "--allow_config_change")


def test_resume_with_longer_schedule_and_other_logging_needs_no_flag(capsys, tmp_path):
    _finished(capsys, tmp_path)
    changed = _other_config(tmp_path, job({"max_steps": 4, "logging_steps": 2,
                                           "checkpoint": {"interval_steps": 2, "keep_last": 5}}))
    out = run_train(capsys, tmp_path, "--config", changed, "--resume", "auto", config=None, keep=tmp_path / "nothing")
    assert out.rc == 0, out.err
    assert [r["step"] for r in _rows(tmp_path)] == [1, 2, 4]


def test_resume_with_another_model_is_refused_and_cannot_be_forced(capsys, tmp_path):
    _finished(capsys, tmp_path)
    changed = _other_config(tmp_path, job({"checkpoint": {"interval_steps": 1}}, model={"default_size": "small"}))
    refused = run_train(capsys, tmp_path, "--config", changed, "--resume", "auto", "--max_steps", "3", config=None)
    refused.assert_refused("model.default_size: 'tiny' in the checkpoint, 'small' now")
    forced = run_train(capsys, tmp_path, "--config", changed, "--resume", "auto", "--max_steps", "3",
                       "--allow_config_change", "model.default_size", config=None, keep=tmp_path / "out" / "checkpoints")
    forced.assert_refused("does not fit this model", "checkpoint-000002", "the config it was written with")


LORA = {"enabled": True, "r": 4, "target_modules": "q_proj,v_proj"}


def test_resume_with_lora_switched_on_is_refused_and_cannot_be_forced(capsys, tmp_path):
    _finished(capsys, tmp_path)
    changed = _other_config(tmp_path, job({"checkpoint": {"interval_steps": 1}}, lora=LORA))
    refused = run_train(capsys, tmp_path, "--config", changed, "--resume", "auto", "--max_steps", "3", config=None)
    refused.assert_refused("lora.enabled: False in the checkpoint, True now", "--allow_config_change lora.enabled")
    forced = run_train(capsys, tmp_path, "--config", changed, "--resume", "auto", "--max_steps", "3",
                       "--allow_config_change", "lora.enabled,lora.r,lora.target_modules", config=None,
                       keep=tmp_path / "out" / "checkpoints")
    forced.assert_refused("no lora adapters", "run without lora")


def test_resume_with_lora_switched_off_is_refused_and_cannot_be_forced(capsys, tmp_path):
    _finished(capsys, tmp_path, job({"checkpoint": {"interval_steps": 1}}, lora=LORA))
    changed = _other_config(tmp_path, job({"checkpoint": {"interval_steps": 1}}))
    refused = run_train(capsys, tmp_path, "--config", changed, "--resume", "auto", "--max_steps", "3", config=None)
    refused.assert_refused("lora.enabled: True in the checkpoint, False now")
    forced = run_train(capsys, tmp_path, "--config", changed, "--resume", "auto", "--max_steps", "3",
                       "--allow_config_change", "lora.enabled,lora.r,lora.target_modules", config=None,
                       keep=tmp_path / "out" / "checkpoints")
    forced.assert_refused("holds lora adapters, not full model weights", "run with lora")


def test_resume_with_another_lora_rank_cannot_be_forced(capsys, tmp_path):
    _finished(capsys, tmp_path, job({"checkpoint": {"interval_steps": 1}}, lora=LORA))
    changed = _other_config(tmp_path, job({"checkpoint": {"interval_steps": 1}}, lora={**LORA, "r": 8}))
    run_train(capsys, tmp_path, "--config", changed, "--resume", "auto", "--max_steps", "3", config=None
              ).assert_refused("lora.r: 4 in the checkpoint, 8 now")
    run_train(capsys, tmp_path, "--config", changed, "--resume", "auto", "--max_steps", "3",
              "--allow_config_change", "lora.r", config=None, keep=tmp_path / "out" / "checkpoints"
              ).assert_refused("does not fit this model", "size mismatch")


def test_checkpoint_written_before_configs_were_saved_still_resumes(capsys, tmp_path):
    checkpoints = _finished(capsys, tmp_path)
    old = checkpoints / "checkpoint-000002"
    (old / "config.json").unlink()
    manifest = json.loads((old / "manifest.json").read_text())
    del manifest["files"]["config.json"]
    (old / "manifest.json").write_text(json.dumps(manifest))
    out = run_train(capsys, tmp_path, "--resume", "auto", "--max_steps", "3", keep=tmp_path / "nothing")
    assert out.rc == 0, out.err
    assert "has no saved config" in out.err and "checkpoint-000002 at step 2" in out.err


@pytest.mark.parametrize("args,fragments", [
    (["--allow_config_change", "training.learnig_rate", "--resume", "auto"],
     ["unknown config key 'training.learnig_rate'", "did you mean training.learning_rate"]),
    (["--allow_config_change", "training.learning_rate"], ["applies when resuming", "--resume auto"]),
], ids=["unknown-key", "without-resume"])
def test_allow_config_change_misuse(capsys, tmp_path, args, fragments):
    run_train(capsys, tmp_path, *args).assert_refused(*fragments)


def test_resume_from_a_missing_path_says_it_does_not_exist(capsys, tmp_path):
    missing = tmp_path / "nowhere" / "checkpoint-000002"
    run_train(capsys, tmp_path, "--resume", str(missing)).assert_refused(f"{missing} does not exist", "--resume auto")


def test_resume_from_a_file_is_refused(capsys, tmp_path):
    checkpoints = _finished(capsys, tmp_path)
    weights = checkpoints / "checkpoint-000002" / "optimizer.pt"
    run_train(capsys, tmp_path, "--resume", str(weights)).assert_refused("is a file, not a checkpoint folder")


def test_resume_from_an_output_folder_names_its_checkpoints(capsys, tmp_path):
    checkpoints = _finished(capsys, tmp_path)
    run_train(capsys, tmp_path, "--resume", str(tmp_path / "out")).assert_refused(
        "is not a checkpoint folder", f"--resume {checkpoints / 'checkpoint-000002'}", "--resume auto")


# --- a broken run ---------------------------------------------------------------------------------

def test_huge_learning_rate_stops_the_run_before_a_checkpoint_holds_nan(capsys, tmp_path):
    """1e20 really drives the tiny model's loss to NaN at step 2 (1e6 only makes it huge)."""
    out = run_train(capsys, tmp_path, config=job({"learning_rate": 1.0e20, "checkpoint": {"interval_steps": 1}}))
    out.assert_refused("training diverged at step 2", "the loss is nan", "learning rate too high",
                       "checkpoint-000001", "--resume auto", "--overwrite")
    checkpoints = tmp_path / "out" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["checkpoint-000001"]
    assert not (tmp_path / "out" / "final").exists() and not (tmp_path / "out" / "logs" / "summary.json").exists()
    assert all(r["step"] == 1 for r in _rows(tmp_path))  # the NaN row is not written


def test_learning_rate_that_overflows_adamw_is_refused(capsys, tmp_path):
    run_train(capsys, tmp_path, config=job({"learning_rate": 1.0e38})).assert_refused(
        "training.learning_rate 1e+38 overflows float32", "1e-5 to 1e-3")


def test_nan_between_logging_steps_is_caught_before_the_checkpoint(capsys, tmp_path, monkeypatch):
    """Loss read once per 2 steps, checkpoint every step: the step-3 NaN must not reach checkpoint 3."""
    from transformers import Qwen3ForCausalLM

    real = Qwen3ForCausalLM.__call__
    calls = {"n": 0}

    def forward(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        calls["n"] += 1
        if calls["n"] == 3:
            out.loss = out.loss * float("nan")
        return out

    monkeypatch.setattr(Qwen3ForCausalLM, "__call__", forward)
    out = run_train(capsys, tmp_path, config=job({"max_steps": 4, "logging_steps": 2,
                                                  "checkpoint": {"interval_steps": 1}}))
    out.assert_refused("training diverged at step 3", "not finite", "checkpoint-000002")
    assert sorted(p.name for p in (tmp_path / "out" / "checkpoints").iterdir()) == ["checkpoint-000001",
                                                                                   "checkpoint-000002"]


def test_nan_weights_with_a_finite_loss_are_not_saved(capsys, tmp_path, monkeypatch):
    real = torch.optim.AdamW.step

    def step(self, *args, **kwargs):
        result = real(self, *args, **kwargs)
        if self.state[self.param_groups[0]["params"][0]]["step"] == 2:
            with torch.no_grad():
                self.param_groups[0]["params"][0].fill_(float("inf"))
        return result

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    out = run_train(capsys, tmp_path, config=job({"logging_steps": 5, "max_steps": 3,
                                                  "checkpoint": {"interval_steps": 2}}))
    out.assert_refused("training diverged at step 2", "the weights hold nan or inf", "no checkpoint was written")
    assert not (tmp_path / "out" / "checkpoints").exists() or not list((tmp_path / "out" / "checkpoints").iterdir())


# --- data with nothing to learn from --------------------------------------------------------------

def _prompt_completion(path: Path, records: list[tuple[int, str]]) -> Path:
    path.write_text("".join(json.dumps({"prompt": "p" * n, "completion": c}) + "\n" for n, c in records))
    return path


def test_data_whose_completions_are_all_cut_off_is_refused_with_the_numbers(capsys, tmp_path):
    data = _prompt_completion(tmp_path / "long_prompts.jsonl", [(600 + i, "the answer") for i in range(20)])
    out = run_train(capsys, tmp_path, config=job(data={"path": str(data)}))
    out.assert_refused("the first 8 batches have no trainable tokens", "8 of 8", "training.max_tokens=512",
                       "the loss starts at token 601", "raise training.max_tokens to at least 602",
                       "the longest of these samples has")


def test_some_fully_masked_batches_are_counted_and_reported_once(capsys, tmp_path):
    records = [(20, "a short answer " * 2)] * 60 + [(600, "cut off")] * 12
    data = _prompt_completion(tmp_path / "mixed.jsonl", records)
    out = run_train(capsys, tmp_path, config=job({"max_steps": 10}, data={"path": str(data)}))
    assert out.rc == 0, out.err
    rows = _rows(tmp_path)
    masked = sum(r["masked_batches"] for r in rows)
    assert masked > 0 and out.err.count("had no trainable token") == 1
    assert json.loads((tmp_path / "out" / "logs" / "summary.json").read_text())["masked_batches"] == masked
    assert all(r["loss"] is None or r["loss"] == r["loss"] for r in rows)  # no NaN rows


# --- LoRA targets ---------------------------------------------------------------------------------

def test_lora_targets_the_model_does_not_have(capsys, tmp_path):
    out = run_train(capsys, tmp_path, config=job(lora={**LORA, "target_modules": "q_proj,query_key_value,c_attn"}))
    out.assert_refused("lora.target_modules names modules this model does not have: query_key_value, c_attn",
                       "its linear modules are:", "q_proj", "v_proj", "set lora.target_modules")


def test_peft_wrapping_errors_are_a_clear_exit(capsys, tmp_path, monkeypatch):
    import peft

    def fail(*args, **kwargs):
        raise ValueError("Target module Qwen3RMSNorm() is not supported")

    monkeypatch.setattr(peft, "get_peft_model", fail)
    out = run_train(capsys, tmp_path, config=job(lora=LORA))
    out.assert_refused("peft could not add lora adapters", "is not supported", "check the lora section")


# --- more processes than GPUs ---------------------------------------------------------------------

def test_more_local_ranks_than_gpus_is_refused(capsys, tmp_path, monkeypatch):
    for key, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda *a: pytest.fail("set_device on a GPU that is not there"))
    out = run_train(capsys, tmp_path, "--device", "cuda")
    out.assert_refused("torchrun started 2 processes", "local rank 1", "1 cuda gpu(s) are visible",
                       "--nproc_per_node 1", "--device cpu")
