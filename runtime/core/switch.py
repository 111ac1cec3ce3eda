"""Switches: the config enums spelled ``on`` / ``off`` (/ ``auto``), such as ``engine.overlap`` and ``model.fused``.

What a Hydra user types for a switch is ``true`` / ``false``, and Hydra's override grammar reads those as booleans
before the structured-config schema sees them (so does YAML, and YAML 1.1 also reads a bare ``on`` / ``off`` as
``True`` / ``False``), while OmegaConf's enum nodes refuse every boolean. A :class:`Switch` takes ``True`` (or the
string ``true``) as its ``on`` member and ``False`` (``false``) as its ``off`` member, where it has one, on the
command line, in YAML and in Python (``OverlapMode(True)``); a switch's other values are unchanged, and anything
else still fails at compose time with the valid list. Importing this module (the schemas in
:mod:`runtime.core.config` do) teaches OmegaConf's enum conversion that rule for :class:`Switch` subclasses only;
every other enum converts as before.
"""

from __future__ import annotations

import enum
from typing import Any

from omegaconf.errors import ValidationError
from omegaconf.nodes import EnumNode

#: boolean -> the member name it stands for
BOOL_NAMES = {True: "on", False: "off"}
_BOOL_WORDS = {"true": True, "false": False}


def as_bool(value: object) -> bool | None:
    """``value`` as a boolean when it is one (``True``, or the word ``true`` in any case), else None."""
    if isinstance(value, bool):
        return value
    return _BOOL_WORDS.get(value.lower()) if isinstance(value, str) else None


class Switch(str, enum.Enum):
    """Base of the on / off (/ auto) config enums: ``True`` is ``on``, ``False`` is ``off``."""

    @classmethod
    def from_bool(cls, value: bool) -> Switch | None:
        """The member a boolean stands for, or None when this switch has no such member."""
        return cls.__members__.get(BOOL_NAMES[value])

    @classmethod
    def bool_hint(cls) -> str:
        """How booleans read for this switch, for error messages: 'true means on, false means off'."""
        return ", ".join(f"{str(b).lower()} means {name}" for b, name in BOOL_NAMES.items() if name in cls.__members__)

    @classmethod
    def _missing_(cls, value: object) -> Switch | None:
        b = as_bool(value)
        return None if b is None else cls.from_bool(b)


def _is_switch(enum_type: Any) -> bool:
    return isinstance(enum_type, type) and issubclass(enum_type, Switch)


def _install() -> None:
    """Wrap OmegaConf's enum conversion (``EnumNode.validate_and_convert_to_enum``) once: a boolean given to a
    :class:`Switch` becomes its on / off member; a refused value of a switch says what booleans mean."""
    convert = EnumNode.validate_and_convert_to_enum
    if getattr(convert, "switch_aware", False):
        return

    def validate_and_convert_to_enum(enum_type: type[enum.Enum], value: Any) -> enum.Enum:
        if not _is_switch(enum_type):
            return convert(enum_type, value)
        if (b := as_bool(value)) is not None and (member := enum_type.from_bool(b)) is not None:
            return member
        try:
            return convert(enum_type, value)
        except ValidationError as e:
            raise ValidationError(f"{e} ({enum_type.bool_hint()})") from e

    validate_and_convert_to_enum.switch_aware = True  # type: ignore[attr-defined]
    EnumNode.validate_and_convert_to_enum = staticmethod(validate_and_convert_to_enum)  # type: ignore[method-assign]


_install()
