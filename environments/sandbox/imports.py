"""What Python code a sandboxed program can import: the standard library only, unless a run opts
into named packages. The host's read-only tree still holds third-party code (the interpreter's
``site-packages``, ``/usr/lib/python3/dist-packages``, SDKs that vendor their own ``yaml`` and
``requests``); ``package_masks`` finds where, once per process, and the bubblewrap backend hides
those folders behind empty read-only mounts. ``package_sources`` resolves an opted-in package on the
host, to be mounted read-only at ``PACKAGES_DIR``."""

from __future__ import annotations

import importlib.util
import os
import re
from functools import cache

PACKAGES_DIR = "/packages"
"""Where opted-in packages are mounted inside the sandbox (appended to the program's ``sys.path``)."""

_PYTHON_FILE = re.compile(r"\.(py|pyc|pth|egg)$|\.(cpython-[^.]+|abi3)\.so$")
_SUBTREES = ("lib", "lib32", "lib64", "libx32", "libexec", "share", "local/lib", "local/share")


def _holds_python(top: str) -> bool:
    """Whether any file under ``top`` is importable Python (source, bytecode, extension, .pth)."""
    for _, _, files in os.walk(top):
        if any(_PYTHON_FILE.search(f) for f in files):
            return True
    return False


def _subdirs(path: str) -> list[str]:
    try:
        with os.scandir(path) as it:
            return sorted(e.path for e in it if e.is_dir(follow_symlinks=False))
    except OSError:
        return []


def _is_library_dir(path: str) -> bool:
    """A folder of shared libraries (``/usr/lib/x86_64-linux-gnu``): never hidden as a whole."""
    try:
        with os.scandir(path) as it:
            return any(".so" in e.name and not _PYTHON_FILE.search(e.name) for e in it if e.is_file())
    except OSError:
        return False


def _masks_under(base: str) -> list[str]:
    out = []
    for child in _subdirs(base):
        if os.path.isfile(os.path.join(child, "os.py")):  # a standard library: keep, less its packages
            out += [
                p
                for p in (os.path.join(child, n) for n in ("site-packages", "dist-packages"))
                if os.path.isdir(p) and not os.path.islink(p)  # a link's target is masked where it lies
            ]
        elif _is_library_dir(child):
            out += [d for d in _subdirs(child) if _holds_python(d)]
        elif _holds_python(child):
            out.append(child)
    return out


@cache
def package_masks(roots: tuple[str, ...]) -> tuple[str, ...]:
    """The folders under ``roots`` (the read-only trees the sandbox binds, real paths) that hold
    Python code outside a standard library: every ``site-packages``/``dist-packages`` of a standard
    library, and each first-level folder of a ``lib``/``share`` tree that holds any Python file
    (``/usr/lib/python3``, ``/usr/lib/google-cloud-sdk``), looking one level deeper in folders of
    shared libraries. Walked once per process per ``roots``."""
    out: list[str] = []
    for root in roots:
        lib_root = os.path.basename(root) in ("lib", "lib32", "lib64", "libx32")  # /lib of a split /usr
        for base in [root] if lib_root else [os.path.join(root, sub) for sub in _SUBTREES]:
            if os.path.isdir(base) and not os.path.islink(base):
                out += _masks_under(base)
    return tuple(dict.fromkeys(out))


@cache
def package_sources(name: str) -> tuple[tuple[str, str], ...]:
    """(host path, name inside ``PACKAGES_DIR``) to mount for the top-level package or module
    ``name`` as the host's interpreter finds it: the package folder (and a wheel's ``<name>.libs``
    beside it) or the module's file. ValueError where the host cannot import it."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        raise ValueError(f"sandbox package {name!r} is not importable by this host's Python")
    locations = list(spec.submodule_search_locations or [])
    if locations:
        if len(locations) != 1:
            raise ValueError(
                f"sandbox package {name!r} is a namespace package spread over {len(locations)} folders"
            )
        src = os.path.realpath(locations[0])
        out = [(src, name)]
        libs = f"{src}.libs"
        if os.path.isdir(libs):
            out.append((libs, os.path.basename(libs)))
        return tuple(out)
    if not spec.origin or not os.path.isfile(spec.origin):
        raise ValueError(f"sandbox package {name!r} is built into the interpreter: it needs no opt-in")
    src = os.path.realpath(spec.origin)
    return ((src, os.path.basename(src)),)
