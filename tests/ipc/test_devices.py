"""Device names as the daemon resolves them, through the CUDA driver and without torch:
the names torch prints for the same devices (manifests compare them as strings), bad
names refused, and a GPU's UUID only for a GPU CUDA shows the process."""

from __future__ import annotations

import pytest

from preload.ipc.devices import cuda_device_count, gpu_uuid, resolve_device_name


@pytest.mark.parametrize("name", ["cpu", "cuda", "cuda:0", "cuda:3"])
def test_explicit_names_are_kept_as_torch_prints_them(name):
    import torch

    assert resolve_device_name(name) == name == str(torch.device(name))


@pytest.mark.parametrize("name", ["gpu0", "cuda:", "cuda:x", "CPU", "cuda:0 ", "mps"])
def test_other_names_are_refused(name):
    with pytest.raises(ValueError, match="choose auto, cpu, cuda or cuda:N"):
        resolve_device_name(name)


def test_auto_agrees_with_torch():
    import torch

    assert resolve_device_name("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    assert cuda_device_count() == torch.cuda.device_count()


def test_a_gpu_cuda_does_not_show_has_no_uuid():
    count = cuda_device_count()
    with pytest.raises(ValueError, match=f"CUDA shows this process {count} GPU"):
        gpu_uuid(f"cuda:{count}")



def test_data_parallel_ranks_take_consecutive_gpus_or_each_the_cpu(monkeypatch):
    from preload.ipc import devices

    assert devices.data_parallel_devices("cpu", 3) == ["cpu"] * 3
    assert devices.data_parallel_devices("cuda", 1) == ["cuda"]  # (one rank: the name as given, as before)
    monkeypatch.setattr(devices, "cuda_device_count", lambda: 4)
    assert devices.data_parallel_devices("cuda", 2) == ["cuda:0", "cuda:1"]
    assert devices.data_parallel_devices("cuda:1", 3) == ["cuda:1", "cuda:2", "cuda:3"]
    with pytest.raises(ValueError, match="needs GPUs 2 to 4: CUDA shows this process 4"):
        devices.data_parallel_devices("cuda:2", 3)
