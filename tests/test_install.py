"""The install as a user meets it: `import linvision` from a folder that holds a directory named linvision (a
clone's parent folder, say) still finds the installed package and its models, not an empty namespace package."""
import os

from support import PY, ROOT, run_subprocess

CHECK = ("import linvision, timm, linvision.kernels, linvision.tools; "
         "m = timm.create_model('mlla_tiny', depths=(1, 1, 1, 1)); "
         "print(linvision.__file__, type(m).__name__, linvision.kernels.__name__)")


def test_import_from_a_folder_holding_a_linvision_directory(tmp_path):
    for clone in (tmp_path / "linvision", tmp_path / "linvision" / "linvision"):  # the clone, and a stray copy
        clone.mkdir()
    (tmp_path / "linvision" / "README.md").write_text("a folder named like the package, without its code\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = run_subprocess([PY, "-c", CHECK], cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    path, model, kernels = proc.stdout.split()
    assert os.path.samefile(path, os.path.join(ROOT, "linvision", "__init__.py"))
    assert (model, kernels) == ("Mlla", "linvision.kernels")
