"""The YAML configs shipped with linvision, installed as package data of ``linvision.configs``: a tool's
``--config NAME`` finds ``NAME`` or ``NAME.yaml`` here when no such file exists on disk."""
