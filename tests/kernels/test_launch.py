"""kernels/launch.py on the CPU: which calls count as one kind, and what is launched as it is.
(Launches through a kept launcher need a GPU: tests/gpu/test_launch.py.)"""

from __future__ import annotations

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from preload.kernels.launch import _kind, _kinds, launcher


def test_tensors_of_one_kind_differ_only_in_address_and_keep_their_alignment():
    a, b = torch.zeros(64, dtype=torch.bfloat16), torch.ones(64, dtype=torch.bfloat16)
    assert _kind(a) == _kind(b)
    assert _kind(a[1:]) != _kind(a)  # 2 bytes in: not 16-aligned, another kernel
    assert _kind(a[8:]) == _kind(a)  # 16 bytes in: aligned again
    assert _kind(a) != _kind(a.float())


def test_any_other_argument_is_its_type_and_value():
    assert _kind(16) == _kind(16) and _kind(17) != _kind(16)
    assert _kind(1) != _kind(True) and _kind(1) != _kind(1.0)  # (equal in Python, three kernels in Triton)
    assert _kind(0.125) == _kind(0.125) and _kind(None) == _kind(None)


def test_a_calls_kinds_tell_apart_what_each_arguments_kind_does():
    """_kinds, a launch's arguments together (tensors and ints inline), draws the same lines."""
    a = torch.zeros(64, dtype=torch.bfloat16)
    calls = [(a, 16, 0.5), (a[8:], 16, 0.5), (a[1:], 16, 0.5), (a.float(), 16, 0.5), (a, 17, 0.5), (a, True, 0.5),
             (a, 1, 0.5), (a, 1.0, 0.5), (a, 16, None), (a, 16, 0.25)]
    for one in calls:
        for other in calls:
            assert (_kinds(one) == _kinds(other)) == (tuple(map(_kind, one)) == tuple(map(_kind, other)))


def test_descriptors_of_one_kind_share_all_but_their_base():
    a, b = torch.zeros(256, 128, dtype=torch.bfloat16), torch.zeros(256, 128, dtype=torch.bfloat16)
    assert _kind(TensorDescriptor.from_tensor(a, [64, 64])) == _kind(TensorDescriptor.from_tensor(b, [64, 64]))
    assert _kind(TensorDescriptor.from_tensor(a, [64, 64])) != _kind(TensorDescriptor.from_tensor(a, [32, 64]))
    assert _kind(TensorDescriptor.from_tensor(a, [64, 64])) != _kind(TensorDescriptor.from_tensor(a[:128], [64, 64]))


def test_what_is_not_the_jits_kernel_is_launched_as_it_is():
    """Triton's interpreter's kernels (these tests'), a benchmark's timing wrapper."""
    from triton.runtime.jit import JITFunction

    from preload.kernels.head_matvec import _head_matvec
    from preload.kernels.launch import Launcher

    wrapper = object()
    assert launcher(wrapper) is wrapper
    if isinstance(_head_matvec, JITFunction):  # (TRITON_INTERPRET=0 on a GPU host)
        assert isinstance(launcher(_head_matvec), Launcher) and launcher(_head_matvec) is launcher(_head_matvec)
    else:
        assert launcher(_head_matvec) is _head_matvec
