"""The CPU kernels' build: sources compile in parallel, a second builder of the same
library waits for the first instead of compiling it again, a failure names its source;
the kernels' sources compile for the x86 CPU classes this machine is not."""

from __future__ import annotations

import concurrent.futures
import ctypes
import os
import platform
import stat
import subprocess
import threading

import pytest

from pallas_kernels import cpu_build


@pytest.fixture
def logged_compiler(tmp_path, monkeypatch):
    """$CXX: a wrapper that logs each call (one line: compile or link) and runs the real one."""
    real = os.environ.get("CXX") or "c++"
    log = tmp_path / "calls.log"
    wrapper = tmp_path / "cxx"
    wrapper.write_text(f'#!/bin/sh\nsleep 0.5\necho "$*" >> {log}\nexec {real} "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CXX", str(wrapper))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return log


def _sources(tmp_path, second_body: str = "return 2;"):
    one, two = tmp_path / "one.cc", tmp_path / "two.cc"
    one.write_text('extern "C" int One() { return 1; }\n')
    two.write_text(f'extern "C" int Two() {{ {second_body} }}\n')
    return one, two


def test_two_builders_of_one_library_compile_it_once(tmp_path, logged_compiler):
    sources = _sources(tmp_path)
    barrier, libs, errors = threading.Barrier(2), [], []

    def build():
        barrier.wait()
        try:
            libs.append(cpu_build.build(sources, "test_lib"))
        except Exception as e:  # noqa: BLE001 - the test reports it
            errors.append(e)

    threads = [threading.Thread(target=build) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    calls = logged_compiler.read_text().splitlines()
    # Two sources compiled (each with -c) and one link: by one of the two builders only.
    assert sum(" -c " in c for c in calls) == 2 and sum("-shared" in c for c in calls) == 1, calls
    assert [lib.One() + lib.Two() for lib in libs] == [3, 3]
    again = cpu_build.build(sources, "test_lib")  # cached: no call
    assert len(logged_compiler.read_text().splitlines()) == 3 and ctypes.CDLL(again._name).Two() == 2


def test_a_failed_compile_names_its_source(tmp_path, logged_compiler):
    sources = _sources(tmp_path, second_body="return undefined_name;")
    with pytest.raises(cpu_build.BuildError, match=r"(?s)compiling two.cc failed:.*undefined_name"):
        cpu_build.build(sources, "test_lib_broken")
    assert not list((tmp_path / "cache").rglob("*.so"))  # nothing half-built is left to load


def test_a_changed_header_in_a_kernels_folder_rebuilds_the_library(tmp_path, logged_compiler, monkeypatch):
    """The library's key covers every header under pallas_kernels/, the attention kernel's
    own folder included (its parts are headers there): a stale library must never load."""
    root = tmp_path / "pallas_kernels"
    (root / "kernel").mkdir(parents=True)
    header, source = root / "kernel" / "part.h", root / "kernel" / "kernel.cc"
    source.write_text('#include "part.h"\nextern "C" int Value() { return VALUE; }\n')
    monkeypatch.setattr(cpu_build, "ROOT", root)
    header.write_text("#define VALUE 1\n")
    assert cpu_build.build((source,), "test_lib_header").Value() == 1
    header.write_text("#define VALUE 2\n")
    assert cpu_build.build((source,), "test_lib_header").Value() == 2


# The kernels take other paths (#if) on AVX2, on AVX-512 with and without bfloat16 and with
# AMX; a build covers only its own machine's. A change that compiled here once broke every
# AVX-512 build (a function defined for AVX2 without AVX-512 only, called from code that
# AVX-512 builds compile too). GCC's names: x86-64-v3 is AVX2 + FMA; sapphirerapids has
# AVX-512, its bfloat16 and AMX.
OTHER_CPUS = ("x86-64-v3", "sapphirerapids")


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the x86 CPU classes' paths")
def test_the_kernels_compile_for_the_other_x86_cpu_classes():
    """Every source of the library, checked by the compiler (-fsyntax-only: no code made)
    as for each of OTHER_CPUS, with the build's own flags, include paths and oneDNN
    arguments."""
    try:
        compiler, compile_args = cpu_build.find_compiler(), cpu_build.onednn_build_args()[0]
    except cpu_build.BuildError as e:
        pytest.skip(f"no compiler or no oneDNN headers: {e}")
    flags = [f for f in cpu_build.FLAGS if not f.startswith("-march=")]
    commands = [
        [compiler, *flags, f"-march={cpu}", "-fsyntax-only", *cpu_build.include_args(), *compile_args, str(source)]
        for cpu in OTHER_CPUS
        for source in (cpu_build.ATTENTION, cpu_build.MATMUL, cpu_build.INT8)
    ]  # fmt: skip
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        procs = list(pool.map(lambda cmd: subprocess.run(cmd, capture_output=True, text=True), commands))
    failed = [
        f"{cmd[len(flags) + 1]} {cmd[-1]}:\n{p.stderr[-2000:]}"
        for cmd, p in zip(commands, procs, strict=True)
        if p.returncode
    ]
    assert not failed, "\n".join(failed)
