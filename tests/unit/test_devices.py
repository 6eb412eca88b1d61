from trainpod.devices import visible_gpu_count


def test_cuda_visible_devices_counts():
    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": "0,1,3"}) == 3
    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": ""}) == 0
    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": "-1"}) == 0
    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": "0,-1,2"}) == 1
    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": "GPU-8f2c,GPU-11ab"}) == 2


def test_device_nodes_are_counted(tmp_path):
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"):
        (tmp_path / name).touch()
    assert visible_gpu_count({}, dev_glob=str(tmp_path / "nvidia[0-9]*")) == 2
    assert visible_gpu_count({}, dev_glob=str(tmp_path / "none[0-9]*")) == 0
