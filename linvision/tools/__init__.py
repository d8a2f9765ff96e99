"""linvision's command-line tools, installed as ``linvision.tools`` with a console script each
(``linvision-train``, ``linvision-validate``, ...; see pyproject.toml) and runnable as
``python -m linvision.tools.<tool>`` or, in a checkout, ``python tools/<tool>.py``."""
