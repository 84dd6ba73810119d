"""hasten's extensions use the process's shared libstdc++, never a private static copy.

A toolchain whose private folder holds only libstdc++.a linked it into the extensions; with
Python's -Bsymbolic-functions that copy's functions ran against the shared library's locale data
and `ostream << long` segfaulted (setup.py: _shared_libstdcxx). This reads the built files, so it
catches the regression on any machine that builds hasten, with or without a GPU.
"""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import hasten

EXTENSIONS = sorted(Path(hasten.__file__).parent.glob("_*.so"))

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ELF linkage is a Linux matter"),
    pytest.mark.skipif(shutil.which("readelf") is None or shutil.which("nm") is None,
                       reason="binutils (readelf, nm) are not installed"),
]


def test_the_compiled_extension_is_there():
    assert any(p.name.startswith("_C.") for p in EXTENSIONS), f"no hasten/_C*.so next to {hasten.__file__}"


@pytest.mark.parametrize("library", EXTENSIONS, ids=lambda p: p.name.split(".")[0])
def test_extension_links_the_shared_libstdcxx(library):
    dynamic = subprocess.run(["readelf", "-d", str(library)], capture_output=True, text=True, check=True).stdout
    assert "[libstdc++.so.6]" in dynamic, f"{library.name} does not load libstdc++.so.6:\n{dynamic}"
    # a static copy shows as libstdc++'s own locale machinery defined inside the extension
    defined = subprocess.run(["nm", "-D", "-C", "--defined-only", str(library)], capture_output=True, text=True,
                             check=True).stdout
    copies = [line for line in defined.splitlines()
              if "std::locale::classic()" in line or "std::ios_base::Init::" in line]
    assert copies == [], f"{library.name} carries its own libstdc++: {copies[:3]}"
