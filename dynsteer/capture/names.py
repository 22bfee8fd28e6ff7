"""How capture places and tags are named in files and wire formats, and what a tag may be."""

from __future__ import annotations

from dynsteer.spec import NAME_PATTERN, Site, SteeringValidationError

Place = tuple[int, Site]  # (decoder layer, residual site)

# What a capture tag may be: it names files and folders under a capture root, so one path component that cannot
# be ``.``/``..``, hidden or absolute, whatever the consumer. The same pattern as every registered name.
SAFE_TAG = NAME_PATTERN


def check_tag(tag: str, field: str = "tag") -> str:
    """``tag`` if it matches :data:`SAFE_TAG`.

    Args:
        tag: a request's correlation tag (it names capture files).
        field: where it came from, named first in the error (e.g. ``extra_args.dynsteer.tag``).

    Raises:
        SteeringValidationError: naming ``field``.
    """
    # fullmatch: ``$`` alone would also accept a trailing newline.
    if not isinstance(tag, str) or SAFE_TAG.fullmatch(tag) is None:
        shown = repr(tag) if not isinstance(tag, str) or len(tag) <= 40 else f"{tag[:40]!r}... ({len(tag)} chars)"
        raise SteeringValidationError(f"{field}: tag {shown} is not a valid name (1 to 128 of A-Z a-z 0-9 . _ -, "
                                      f"starting with a letter or digit)")
    return tag


def place_key(place: Place) -> str:
    """``(3, "post_block")`` -> ``"3.post_block"``: how a place is named in files and wire formats."""
    return f"{place[0]}.{place[1]}"


def place_from_key(key: str) -> Place:
    """The inverse of :func:`place_key`."""
    layer, site = key.split(".", 1)
    return int(layer), site  # type: ignore[return-value]
