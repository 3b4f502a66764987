"""Vision-language models: images beside a prompt's tokens.

A row's images travel as one bundle beside its token ids (:class:`grpolab.vision.media.Media`, the ``media`` of a
:class:`grpolab.common.batch.Batch`), through the same rollout service, update and probes as text. What differs from
one architecture to the next (which module projects the vision features, how a row's pixels are laid out, how
positions run over an image) lives in one small adapter per family (:mod:`grpolab.vision.families`).
"""
