"""Networks used across the chapters, one module each: :mod:`.wrn` (the Wide-ResNet),
:mod:`.ghost_bn` (BatchNorm over groups of a batch) and :mod:`.gpt` (a small GPT).

Import from the module itself: this package imports none of them, so a chapter loads only the
network it uses.
"""
