"""Reading compiled programs: optimised HLO text (`jitted.lower(...).compile().as_text()`)."""

import re

# Each instruction of optimised HLO text: its name, element type, opcode and operands (printed by name only).
INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = \(?([a-z0-9]+)\[\S* ([a-z\-]+)\(([^)]*)\)", re.M)


def int8_dots(hlo: str, operand_types: tuple[str, str] = ("s8", "s8")) -> int:
    """How many dots (or the convolutions XLA:TPU makes of them) multiply operands of these two types (default: two
    int8 ones; ("bf16", "s8"): bfloat16 activations against int8 weights as they are stored)."""
    found = INSTRUCTION.findall(hlo)
    types = {name: dtype for name, dtype, _, _ in found}
    count = 0
    for _, _, opcode, operands in found:
        names = [o.strip().lstrip("%") for o in operands.split(",")]
        count += opcode in ("dot", "convolution") and tuple(types.get(n) for n in names[:2]) == operand_types
    return count
