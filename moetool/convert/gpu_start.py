"""The GPU's start for ``moetool quantize --device cuda``, begun on a thread at the command's
first instant instead of once its plan is made.

In a fresh process on an H100 host (Triton's cache warm, an image without bytecode), the first
conversion waited 1.0-1.2 s for the GPU after ``import torch``: Triton's cache key 0.49 s
(``triton.runtime.cache.triton_key``: a sha256 of Triton's sources and of libtriton, once per
process, computed even to load a cached kernel), Triton's driver 0.42 s (its modules and its
launcher's library), CUDA 0.37 s (torch's CUDA start and a first kernel). The key needs no
torch, and its hashing of libtriton runs without the GIL: it is made beside torch's import.
The rest starts the moment the command's own import of torch is done, beside its planning.
``Source._warm_up`` then loads the format's kernel into a started GPU.

Torch-free to import. A hint only: anything that fails is left to the conversion, which starts
what is missing itself and reports what cannot start.
"""
from __future__ import annotations

import threading


def cuda_index(args: list[str]) -> int | None:
    """The CUDA device a command line's ``--device`` names (``cuda`` -> 0, ``cuda:N`` -> N), or
    None (another device, none, or not one this can read)."""
    for i, arg in enumerate(args):
        if arg == "--device":
            value = args[i + 1] if i + 1 < len(args) else ""
        elif arg.startswith("--device="):
            value = arg.partition("=")[2]
        else:
            continue
        kind, _, index = value.partition(":")
        if kind != "cuda":
            return None
        return 0 if not index else int(index) if index.isdigit() else None
    return None


def begin(index: int) -> threading.Thread:
    """Start the GPU of CUDA device ``index`` on a daemon thread (returned, started)."""
    thread = threading.Thread(target=start_gpu, args=(index,), name="moetool-gpu-start", daemon=True)
    thread.start()
    return thread


def start_gpu(index: int) -> None:
    """Triton's cache key, then (importing torch, which waits for an import of it under way in
    another thread) CUDA on device ``index`` and Triton's driver. Quiet on any failure."""
    try:
        from triton.runtime.cache import triton_key

        triton_key()
    except Exception:  # noqa: BLE001 - a hint: another Triton, or none; the conversion will say
        pass
    try:
        import torch
        from triton.runtime import driver

        torch.empty(1, device=f"cuda:{index}")
        driver.active.get_current_device()
    except Exception:  # noqa: BLE001 - no GPU, no driver: the conversion reports it
        pass
