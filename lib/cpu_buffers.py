"""
CPU scratch buffers for the output layer's chunks (lib/head.py): speed machinery that changes no number. glibc maps
each allocation over 32 MB afresh and unmaps it when it is freed, so every fresh (rows, vocab) chunk would
page-fault on its first write; writing into a buffer kept from an earlier chunk does not (docs/performance.md has
the measurement). The buffers are kept until the process ends: as many as were in use at once.
"""
import torch

_buffers = []  # (rows, V) buffers, each reused once no other tensor holds it


def scratch(rows, shape, dtype, device):
    """An uninitialised tensor of shape (n, V), n <= rows, to write a chunk into: on CPU a view of a kept (rows, V)
    buffer that no live tensor shares, elsewhere (and inside a compiled graph) a new tensor."""
    if device.type != "cpu" or torch.compiler.is_compiling():
        return torch.empty(shape, dtype=dtype, device=device)
    for buf in _buffers:  # a view holds its buffer, so a use count of 1 (this list's) means nothing reads it
        if buf.shape == (rows, shape[1]) and buf.dtype == dtype and buf._use_count() == 1:
            return buf[:shape[0]]
    with torch.inference_mode(False):  # one made in rollout's inference mode could not be written outside it
        _buffers.append(torch.empty(rows, shape[1], dtype=dtype))
    return _buffers[-1][:shape[0]]
