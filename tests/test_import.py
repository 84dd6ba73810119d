"""What `import hasten` does: nothing to the process. transformers' registries, its masking
function and the logging set-up stay as they were, and the op library (hasten._C) is not loaded;
accelerate() registers, and the last live handle's undo() restores every one of them.

Each case runs in a fresh interpreter: the test session itself has imported and accelerated
models long before these tests run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import hasten

REPO = Path(__file__).resolve().parent.parent
SRC = Path(hasten.__file__).resolve().parent.parent  # the hasten under test, wherever it is installed

# Run first in every child: a snapshot, by identity, of everything in the process hasten could
# change, and the list of what differs between two snapshots.
PRELUDE = '''
import json, logging, sys
from transformers import AttentionInterface, masking_utils
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
from transformers.masking_utils import AttentionMaskInterface

REGISTRIES = {"AttentionInterface": AttentionInterface, "AttentionMaskInterface": AttentionMaskInterface,
              "ExpertsInterface": type(ALL_EXPERTS_FUNCTIONS)}
_ABSENT = object()

def snapshot():
    # a fresh instance has no local overrides: it reads the process-wide registrations
    state = {name: dict(registry()) for name, registry in REGISTRIES.items()}
    state["find_packed_sequence_indices"] = masking_utils.find_packed_sequence_indices
    log = logging.getLogger("hasten")
    state["hasten logger"] = (log.propagate, tuple(log.handlers), log.level)
    return state

def changes(before, after):
    out = []
    for name in ("AttentionInterface", "AttentionMaskInterface", "ExpertsInterface"):
        b, a = before[name], after[name]
        out += [f"{name}[{key}]" for key in sorted(b.keys() | a.keys())
                if b.get(key, _ABSENT) is not a.get(key, _ABSENT)]
    if before["find_packed_sequence_indices"] is not after["find_packed_sequence_indices"]:
        out.append("masking_utils.find_packed_sequence_indices")
    if before["hasten logger"] != after["hasten logger"]:
        out.append("logging.getLogger('hasten')")
    return out

checks = {}
'''


def run_child(body: str) -> dict:
    """Run PRELUDE + body in a fresh interpreter; body fills `checks`, printed as the last line."""
    code = PRELUDE + textwrap.dedent(body) + "\nprint(json.dumps(checks))\n"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), str(REPO), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_import_registers_patches_and_loads_nothing():
    checks = run_child('''
        before = snapshot()
        import hasten
        checks["import hasten: changed"] = changes(before, snapshot())
        checks["import hasten: transformers integration imported"] = "hasten.integrations.transformers" in sys.modules
        import hasten.integrations.transformers
        hasten.accelerate, hasten.AccelerationHandle, hasten.PackingCollator, hasten.Config  # the public names
        checks["import integration: changed"] = changes(before, snapshot())
        checks["hasten._C loaded"] = "hasten._C" in sys.modules
        checks["hasten.ops modules imported"] = sorted(m for m in sys.modules if m.startswith("hasten.ops"))
    ''')
    assert checks == {
        "import hasten: changed": [],
        "import hasten: transformers integration imported": False,
        "import integration: changed": [],
        "hasten._C loaded": False,
        "hasten.ops modules imported": [],
    }


def test_accelerate_registers_and_the_last_undo_restores_everything():
    checks = run_child('''
        import gc

        import hasten
        import hasten.integrations.transformers as tf
        from hasten.moe import fused_experts_forward
        from tests.tiny_models import MODELS, packed_batch

        # a name that someone registered before hasten: hasten's takes its place, then it is back
        theirs = lambda *args, **kwargs: None
        AttentionInterface.register(tf.DENSE_NAMES["eager"], theirs)
        original_search = masking_utils.find_packed_sequence_indices
        before = snapshot()

        first, second = MODELS["qwen3"](), MODELS["qwen3"]()
        first_handle = hasten.accelerate(first)
        registered = snapshot()
        checks["accelerate: changed"] = changes(before, registered)
        checks["accelerate: hasten._C loaded"] = "hasten._C" in sys.modules
        checks["accelerate: the registered functions are hasten's"] = [
            AttentionInterface()[tf.ATTN_NAME] is tf.hasten_attention_forward,
            AttentionMaskInterface()[tf.ATTN_NAME] is tf.hasten_mask,
            AttentionInterface()[tf.DENSE_NAMES["eager"]] is tf.hasten_dense_attention_forward,
            ALL_EXPERTS_FUNCTIONS[tf.EXPERTS_NAME] is fused_experts_forward,
            masking_utils.find_packed_sequence_indices is not original_search,
        ]
        checks["logger after accelerate"] = [logging.getLogger("hasten").propagate,
                                             len(logging.getLogger("hasten").handlers)]

        second_handle = hasten.accelerate(second)
        checks["second accelerate: changed"] = changes(registered, snapshot())
        first_handle.undo()
        first_handle.undo()  # a second undo of the same handle releases nothing more
        checks["first undo: changed"] = changes(registered, snapshot())
        checks["first model back to"] = first.config._attn_implementation
        loss = second(**packed_batch()).loss  # needs "hasten_varlen", still registered for it
        checks["second model still trains"] = bool(loss.isfinite())

        dropped = MODELS["qwen3"]()
        hasten.accelerate(dropped)  # its handle is dropped at once, never undone
        checks["held, with a model whose handle was dropped"] = tf._REGISTRATIONS.users
        del dropped
        gc.collect()
        checks["held, once that model is collected"] = tf._REGISTRATIONS.users

        second_handle.undo()
        checks["last undo: changed"] = changes(before, snapshot())
        checks["last undo: theirs is back"] = AttentionInterface()[tf.DENSE_NAMES["eager"]] is theirs
        checks["last undo: the search is the original"] = masking_utils.find_packed_sequence_indices is original_search
    ''')
    names = ["hasten_varlen", "hasten_dense_eager", "hasten_dense_sdpa"]
    assert checks == {
        "accelerate: changed": sorted(f"AttentionInterface[{n}]" for n in names)
                               + sorted(f"AttentionMaskInterface[{n}]" for n in names)
                               + ["ExpertsInterface[hasten_fused]", "masking_utils.find_packed_sequence_indices"],
        "accelerate: hasten._C loaded": True,
        "accelerate: the registered functions are hasten's": [True] * 5,
        "logger after accelerate": [True, 0],
        "second accelerate: changed": [],
        "first undo: changed": [],
        "first model back to": "sdpa",
        "second model still trains": True,
        "held, with a model whose handle was dropped": 2,
        "held, once that model is collected": 1,
        "last undo: changed": [],
        "last undo: theirs is back": True,
        "last undo: the search is the original": True,
    }


def test_a_failed_accelerate_leaves_the_process_as_it_was():
    checks = run_child('''
        import hasten
        import hasten.integrations.transformers as tf
        from tests.tiny_models import MODELS

        def broken(model, config, handle):
            raise RuntimeError("a step of accelerate() failed")

        tf._patch_moe = broken  # after attention was patched and the names registered
        model = MODELS["qwen3"]()
        before = snapshot()
        try:
            hasten.accelerate(model)
        except RuntimeError as exc:
            checks["raised"] = str(exc)
        checks["changed"] = changes(before, snapshot())
        checks["model attention"] = model.config._attn_implementation
        checks["registrations held"] = tf._REGISTRATIONS.users
    ''')
    assert checks == {"raised": "a step of accelerate() failed", "changed": [], "model attention": "sdpa",
                      "registrations held": 0}


# ---- the command without its op library ---------------------------------------------------------

# Starts `python -m hasten ...` in a process where hasten._C cannot be imported, missing (not
# built) or broken (built against another torch: an undefined symbol), and writes the modules the
# command had imported to $HASTEN_TEST_MODULES at exit.
WITHOUT_OP_LIBRARY = '''
import atexit, importlib.abc, importlib.machinery, json, os, runpy, sys

class OpLibrary(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname != "hasten._C":
            return None
        if os.environ["HASTEN_TEST_OP_LIBRARY"] == "missing":
            raise ModuleNotFoundError("No module named 'hasten._C'", name=fullname)
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec):
        raise ImportError("_C.so: undefined symbol: _ZN3c1017RegisterOperatorsD1Ev")

    def exec_module(self, module):
        pass

sys.meta_path.insert(0, OpLibrary())
atexit.register(lambda: open(os.environ["HASTEN_TEST_MODULES"], "w").write(json.dumps(sorted(sys.modules))))
runpy.run_module("hasten", run_name="__main__", alter_sys=True)
'''


def run_command(tmp_path: Path, op_library: str, *argv: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    bootstrap = tmp_path / "without_op_library.py"
    bootstrap.write_text(WITHOUT_OP_LIBRARY)
    modules = tmp_path / "modules.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
               HASTEN_TEST_OP_LIBRARY=op_library, HASTEN_TEST_MODULES=str(modules))
    result = subprocess.run([sys.executable, str(bootstrap), *argv], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=300)
    return result, json.loads(modules.read_text())


def test_version_loads_neither_the_op_library_nor_torch(tmp_path):
    result, modules = run_command(tmp_path, "missing", "--version")
    assert (result.returncode, result.stdout.strip()) == (0, f"hasten {hasten.__version__}"), result.stderr
    loaded = [name for name in ("hasten._C", "hasten.ops", "hasten.integrations.transformers", "transformers",
                                "torch") if name in modules]
    assert loaded == []


@pytest.mark.parametrize("op_library", ["missing", "broken"])
def test_doctor_reports_an_op_library_that_does_not_load_as_a_blocker(tmp_path, op_library):
    result, modules = run_command(tmp_path, op_library, "doctor", "--json")
    assert result.returncode == 1, result.stderr  # doctor's exit code for a blocker
    report = json.loads(result.stdout)
    (row,) = [finding for finding in report["findings"] if finding["name"] == "hasten._C"]
    assert row["status"] == "blocker"
    assert "pip install --no-build-isolation -e ." in row["fix"]  # the rebuild
    assert "hasten._C" in row["fix"] and (op_library == "missing" or "undefined symbol" in row["fix"])  # the cause
    assert "hasten.integrations.transformers" not in modules


def test_train_without_the_op_library_is_a_clear_error(tmp_path):
    result, _ = run_command(tmp_path, "broken", "train", "--output_dir", str(tmp_path / "run"), "--max_steps", "1",
                            "--device", "cpu", "--no_progress")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert "hasten._C could not be loaded" in result.stderr and "pip install --no-build-isolation -e ." in result.stderr
    assert not (tmp_path / "run" / "final").exists()
