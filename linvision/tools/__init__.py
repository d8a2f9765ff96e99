"""linvision's command-line tools, installed as ``linvision.tools`` with a console script each (``linvision-train``,
``linvision-validate``, ...; pyproject.toml's ``[project.scripts]`` names the function each runs).

A module per job: ``kernels`` holds the two commands of the Triton kernels, each with a parser of its own (the
module's ``PARSERS`` maps the command's name to it); every other module holds one command, whose parser is
``build_parser()`` and which also runs as ``python -m linvision.tools.<module>`` (or, in a checkout,
``python linvision/tools/<module>.py``)."""
