"""Skip the Triton interpreter's redundant re-patching of ``triton.language`` on every device-function call.

Under ``TRITON_INTERPRET=1`` a kernel launch (``GridExecutor.__call__``) patches ``triton.language`` (and
``triton.language.core``) with the interpreter's semantics, runs every program of the grid, then restores it. Each
call of a ``@triton.jit`` helper inside the kernel (``InterpretedFunction.__call__``: ``logit_tile``, ``transform``,
...) calls ``_patch_lang`` again, once per call per program, and drops the scope it returns (Triton 3.6 to 3.9).
While the launch's patch is in place that second patch finds the same modules already patched: it re-wraps nothing
(a patched member is no longer a builtin) and sets the other attributes to equivalents of what they hold, yet it
walks every module member with ``inspect.getmembers`` each time: about a third of a kernel's time in the interpreter
(tests/test_distill_triton.py). :func:`install` makes a helper's ``_patch_lang`` a no-op when the enclosing launch has
already patched every language module the helper sees; a helper that sees another one is patched as before. The
launch's own patch and its restore are untouched.

Test harness only (the package never imports it). A failure of the premise is loud, not silent: an unpatched builtin
called from a kernel raises (it needs the interpreter's ``_semantic``). ``CCE_TEST_PLAIN_INTERPRETER=1`` turns it off;
tests/test_interpreter_patch_memo.py checks that the kernels give bitwise the same results with and without it,
with both ends of the supported Triton range.
"""

from __future__ import annotations

import inspect
import os

#: How many helper patches were skipped, and how many ran (the launches' own included), since :func:`install`.
stats = {"skipped": 0, "patched": 0}


class _NoRestore:
    """What a skipped patch returns (Triton drops a helper's scope; nothing to restore)."""

    def restore(self) -> None:
        return None


def install() -> bool:
    """Install the memo into the imported Triton's interpreter; True if installed now or before. Does nothing (False)
    unless ``TRITON_INTERPRET=1``, with ``CCE_TEST_PLAIN_INTERPRETER=1``, or where the interpreter lacks the two
    functions it wraps (another Triton: the plain interpreter then runs)."""
    if os.environ.get("TRITON_INTERPRET") != "1" or os.environ.get("CCE_TEST_PLAIN_INTERPRETER") == "1":
        return False
    try:
        import triton.language as tl
        from triton.runtime import interpreter as interp
    except ImportError:
        return False
    patch_lang = getattr(interp, "_patch_lang", None)
    executor = getattr(interp, "GridExecutor", None)
    if patch_lang is None or executor is None:
        return False
    if getattr(patch_lang, "_cce_memo", False):
        return True
    launch = executor.__call__
    #: per launch in progress: the ids of the language modules patched in it so far (None before its own patch)
    patched: list[frozenset[int] | None] = []

    def langs(fn) -> frozenset[int]:
        return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))

    def memo_patch_lang(fn):
        seen = langs(fn)
        if patched and patched[-1] is not None and seen <= patched[-1]:
            stats["skipped"] += 1
            return _NoRestore()
        stats["patched"] += 1
        scope = patch_lang(fn)
        if patched:  # the launch's own patch, or a helper's (Triton never restores one: it holds to the launch's end)
            patched[-1] = seen | (patched[-1] or frozenset())
        return scope

    def memo_launch(self, *args, **kwargs):
        patched.append(None)
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.pop()

    memo_patch_lang._cce_memo = True  # type: ignore[attr-defined]
    interp._patch_lang = memo_patch_lang
    executor.__call__ = memo_launch
    return True
