"""linvision-export --checkpoint RUN traces the run's model at the size it was trained at (not its pretrained
cfg's, which a run at another size may not be able to take), raised to two strides where one would make
torch.export take the sides for constants."""
import torch
from support import run_tool, write_image_folder


def test_a_run_exports_at_its_training_size(tmp_path):
    data = write_image_folder(tmp_path / "data", size=32)
    run_tool("train.py", "--dataset", "folder", "--data-dir", data, "--img-size", "32", "--model", "test_resnet",
             "--batch-size", "4", "--epochs", "1", "--output", str(tmp_path), "--experiment", "run", "--no-progress",
             "--device", "cpu")
    program = tmp_path / "run.pt2"
    proc = run_tool("export.py", "--checkpoint", str(tmp_path / "run"), "--output", str(program))
    first, check = proc.stdout.splitlines()[:2]
    # test_resnet's pretrained cfg says 160 px, not a multiple of its stride of 32; it was trained at 32 px
    assert first.endswith(f"dynamic batch, height and width (multiples of 32), example 64x64) to {program}")
    assert check.startswith(f"check {program} against eager at 64x64, 160x160, 128x64: ") and check.endswith(": ok")
    assert torch.export.load(str(program)).module()(torch.randn(2, 3, 96, 64)).shape == (2, 3)
