"""linvision's command-line tools, installed as ``linvision.tools`` with a console script each (``linvision-train``,
``linvision-validate``, ...; pyproject.toml's ``[project.scripts]`` names the function each runs).

A module per job: ``train``, ``train_seg``, ``validate``, ``benchmark``, ``ablate``, ``linearize``, ``export``,
``model_table``, ``bench_naflex`` and ``gpu_report`` hold one command each, whose parser is ``build_parser()`` and
which also runs as ``python -m linvision.tools.<module>`` (or, in a checkout, ``python linvision/tools/<module>.py``);
``diffusion`` holds the five diffusion commands and ``kernels`` the two of the Triton kernels, each command with
a parser of its own (the module's ``PARSERS`` maps the command's name to it)."""
