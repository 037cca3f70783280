#!/usr/bin/env python3
"""Compile the CUDA example engine's kernels (examples/engines/llama-cuda-bf16/src/kernels.cu) with
NVRTC, with the options the engine's src/device.rs passes (cudarc's CompileOptions with only `arch`
set: `--gpu-architecture=sm_XY`), for sm_90 and sm_80, without a GPU. Fails on any error or warning
in NVRTC's log. When a `ptxas` is found, also assembles each PTX for its architecture with `-v` and
prints registers, spills and shared memory per kernel (spills fail the check).

NVRTC and ptxas come from PyPI wheels installed outside the repository, e.g.

    pip install --target /tmp/nvrtc nvidia-cuda-nvrtc nvidia-cuda-nvcc
    NVRTC_LIB=/tmp/nvrtc/nvidia/cu13/lib/libnvrtc.so.13 PTXAS=/tmp/nvrtc/nvidia/cu13/bin/ptxas \
        python3 scripts/nvrtc-check.py

Without NVRTC_LIB it tries libnvrtc.so.13 and libnvrtc.so.12 on the library path; without PTXAS,
`ptxas` on PATH. Exit status: 0 clean, 1 a compile error, warning or spill, 2 NVRTC not found.
"""

import ctypes
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE = os.path.join(ROOT, "examples", "engines", "llama-cuda-bf16", "src", "kernels.cu")
ARCHS = ["sm_90", "sm_80"]


def load_nvrtc():
    names = [os.environ["NVRTC_LIB"]] if os.environ.get("NVRTC_LIB") else ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def compile_ptx(lib, source, arch):
    """(ok, log, ptx) for one architecture; options exactly as cudarc builds them from CompileOptions { arch }."""
    prog = ctypes.c_void_p()
    rc = lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"kernels.cu", 0, None, None)
    if rc != 0:
        return False, "nvrtcCreateProgram failed: %d" % rc, ""
    opts = [("--gpu-architecture=%s" % arch).encode()]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    buf = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, buf)
    log = buf.value.decode(errors="replace").strip()
    ptx = ""
    if rc == 0:
        lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
        pbuf = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetPTX(prog, pbuf)
        ptx = pbuf.value.decode()
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return rc == 0, log, ptx


def ptxas_report(ptxas, ptx, arch):
    """(ok, lines): ptxas -v per kernel: registers, spill bytes, shared memory."""
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        r = subprocess.run([ptxas, "-v", "-arch=" + arch, src, "-o", os.path.join(d, "k.cubin")],
                           capture_output=True, text=True)
    text = r.stdout + r.stderr
    if r.returncode != 0:
        return False, [text]
    out, ok, name = [], True, None
    for line in text.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            name = m.group(1)
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and name:
            spill = int(m.group(2)) + int(m.group(3))
            stack = int(m.group(1))
            out.append([name, stack, spill])
            if spill:
                ok = False
            continue
        m = re.search(r"Used (\d+) registers.*?(\d+) bytes smem", line)
        if m and out and out[-1][0] == name:
            out[-1] += [int(m.group(1)), int(m.group(2))]
        elif re.search(r"Used (\d+) registers", line) and out and out[-1][0] == name:
            out[-1] += [int(re.search(r"Used (\d+) registers", line).group(1)), 0]
    out = [e for e in out if len(e) > 3]  # entries of device functions (sincos's slow path) have no registers line
    lines = ["  %-22s regs %3s  stack %4d B  spills %4d B  smem %6s B" % (
        n, (e[0] if e else "?"), st, sp, (e[1] if len(e) > 1 else "?")) for n, st, sp, *e in out]
    return ok, lines


def main():
    lib = load_nvrtc()
    if lib is None:
        print("NVRTC not found (set NVRTC_LIB to libnvrtc.so.13 or .12)", file=sys.stderr)
        return 2
    ver = (ctypes.c_int(), ctypes.c_int())
    lib.nvrtcVersion(ctypes.byref(ver[0]), ctypes.byref(ver[1]))
    print("NVRTC %d.%d, %s" % (ver[0].value, ver[1].value, os.path.relpath(SOURCE, ROOT)))
    source = open(SOURCE).read()
    ptxas = os.environ.get("PTXAS") or shutil.which("ptxas")
    failed = False
    for arch in ARCHS:
        ok, log, ptx = compile_ptx(lib, source, arch)
        if not ok or log:
            failed = True
            print("%s: %s\n%s" % (arch, "error" if not ok else "warnings", log))
            continue
        entries = re.findall(r"\.entry (\w+)\(", ptx)
        print("%s: clean, %d kernels, %d bytes of PTX" % (arch, len(entries), len(ptx)))
        if ptxas:
            pok, lines = ptxas_report(ptxas, ptx, arch)
            print("\n".join(lines))
            if not pok:
                failed = True
                print("%s: ptxas failed or a kernel spills" % arch)
    if not ptxas:
        print("ptxas not found (set PTXAS): registers and spills not checked")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
