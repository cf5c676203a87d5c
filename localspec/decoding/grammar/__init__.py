"""Constrained decoding: a :class:`~localspec.settings.constraints.Constraint` (what the caller
asked for) compiled through llguidance (:mod:`.compiler`, its errors located by
:mod:`.schema_errors`), the model's llguidance tokenizer (:mod:`.tokenizer`), the matcher that
follows the committed tokens (:mod:`.follower`), token bitmasks (:mod:`.masks`) and each step's
mask rows (:mod:`.steps`)."""
