"""A GGUF metadata field as GGUFWriter.add_key_value takes it back, for copying metadata
from one file into another (shape_model.py's tokenizer, training/mix_drafters.py)."""
from __future__ import annotations

from gguf import GGUFValueType


def field_value(field):
    """(value, type, array item type or None) of a GGUFReader field."""
    vtype = field.types[0]
    if vtype == GGUFValueType.ARRAY:
        sub = field.types[1]
        if sub == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data], vtype, sub
        return [field.parts[i][0].item() for i in field.data], vtype, sub
    if vtype == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8"), vtype, None
    return field.parts[field.data[0]][0].item(), vtype, None
