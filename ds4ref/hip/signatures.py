"""Kernel parameter lists, read from the kernel sources, and the check of every launch.

Kernel arguments are hand-written tuples; a wrong count or a scalar of the wrong width is
packed without complaint by the driver (a float64 passed to a `float` parameter is 8 bytes
where the kernel reads 4) and corrupts the launch silently. So each `extern "C" __global__`
kernel's parameters are parsed from its source (headers inlined, typedefs resolved, kernels
made by function-like macros expanded) when the source is compiled, and every launch, eager
or recorded, is checked against them. Parsing needs no GPU: tests check every kernel file
and every launch the backend records on the CPU.

The types a launch may pass are those of runtime.pack_args: a DeviceBuffer or None (a null
pointer) for a pointer parameter, a NumPy scalar of exactly the parameter's type otherwise.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .buffers import DeviceBuffer, load_source


class KernelSignatureError(ValueError):
    """A kernel's parameter list could not be read, or holds a type no launch can pass."""


class KernelArgumentError(TypeError):
    """A launch's arguments do not match the kernel's parameters; the message names both."""


# C scalar types (after typedefs, qualifiers dropped) -> the NumPy type pack_args packs them as
SCALAR_TYPES = {
    "int": np.int32, "signed": np.int32, "signed int": np.int32, "int32_t": np.int32,
    "unsigned": np.uint32, "unsigned int": np.uint32, "uint32_t": np.uint32,
    "long long": np.int64, "long long int": np.int64, "signed long long": np.int64, "int64_t": np.int64,
    "unsigned long long": np.uint64, "unsigned long long int": np.uint64, "uint64_t": np.uint64,
    "size_t": np.uint64,
    "float": np.float32, "double": np.float64,
}
_QUALIFIERS = {"const", "volatile", "__restrict__", "__restrict", "restrict", "struct"}


@dataclass(frozen=True)
class Param:
    name: str
    ctype: str              # as written, qualifiers dropped ("const float*" -> "float*")
    pointer: bool
    scalar: type | None     # the NumPy type of a scalar parameter; None for a pointer

    def describe(self) -> str:
        return f"{self.ctype} {self.name}"


@dataclass(frozen=True)
class Signature:
    kernel: str
    source: str             # the file it was parsed from
    params: tuple[Param, ...]

    def check(self, args: Sequence[Any]) -> None:
        """Raise KernelArgumentError unless args is what pack_args would pass to these parameters."""
        where = f"kernel {self.kernel} ({self.source})"
        if len(args) != len(self.params):
            raise KernelArgumentError(
                f"{where}: {len(args)} arguments, the kernel takes {len(self.params)}: "
                f"({', '.join(p.describe() for p in self.params)})")
        for i, (p, a) in enumerate(zip(self.params, args)):
            if p.pointer:
                if a is None or isinstance(a, DeviceBuffer):
                    continue
                want = "a DeviceBuffer or None"
            else:
                if type(a) is p.scalar:
                    continue
                want = f"np.{p.scalar.__name__}"
            raise KernelArgumentError(f"{where}: argument {i} ({p.describe()}) is {_type_name(a)}, "
                                      f"the parameter takes {want}")


def _type_name(a: Any) -> str:
    if a is None:
        return "None"
    t = type(a)
    return f"np.{t.__name__}" if isinstance(a, np.generic) else t.__name__


# ---- a small preprocessor: enough of C for kernel signatures ---------------------------

def _strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def _balanced(text: str, open_at: int) -> int:
    """Index just past the parenthesis that closes the one at open_at."""
    depth = 0
    for i in range(open_at, len(text)):
        c = text[i]
        if c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
            if depth == 0:
                return i + 1
    raise KernelSignatureError(f"unbalanced parentheses from: {text[open_at:open_at + 80]!r}")


def _split_top(text: str, sep: str = ",") -> list[str]:
    out, depth, cur = [], 0, []
    for c in text:
        if c in "(<[":
            depth += 1
        elif c in ")>]":
            depth -= 1
        if c == sep and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(c)
    out.append("".join(cur))
    return out


_DEFINE = re.compile(r"^[ \t]*#[ \t]*define[ \t]+(\w+)(\([^)]*\))?[ \t]*(.*)$", re.M)


def _macros(text: str) -> tuple[dict[str, str], dict[str, tuple[list[str], str]]]:
    """(object-like macros, function-like macros) of text (continuations already joined)."""
    objects, functions = {}, {}
    for m in _DEFINE.finditer(text):
        name, params, body = m.group(1), m.group(2), m.group(3).strip()
        if params is None:
            objects[name] = body
        else:
            functions[name] = ([p.strip() for p in params[1:-1].split(",") if p.strip()], body)
    return objects, functions


def _expand_kernel_macros(text: str, functions: dict[str, tuple[list[str], str]]) -> str:
    """Expand each use of a function-like macro whose body defines a kernel (nested uses too)."""
    makers = {k: v for k, v in functions.items() if "__global__" in v[1]}
    if not makers:
        return text
    use = re.compile(r"\b(" + "|".join(map(re.escape, makers)) + r")[ \t]*\(")
    for _ in range(8):  # a macro may use another: expand until nothing is left
        out, pos, changed = [], 0, False
        for m in use.finditer(text):
            if m.start() < pos or _in_define(text, m.start()):
                continue
            end = _balanced(text, m.end() - 1)
            params, body = makers[m.group(1)]
            args = [a.strip() for a in _split_top(text[m.end():end - 1])]
            if len(args) != len(params):
                raise KernelSignatureError(f"macro {m.group(1)} takes {len(params)} arguments, "
                                           f"given {len(args)}: {text[m.start():end]!r}")
            for p, a in zip(params, args):
                body = re.sub(r"\s*##\s*" + p + r"\b", a, body)
                body = re.sub(r"\b" + p + r"\s*##\s*", a, body)
                body = re.sub(r"\b" + p + r"\b", a, body)
            out += [text[pos:m.start()], " ", body, " "]
            pos, changed = end, True
        if not changed:
            return text
        text = "".join(out) + text[pos:]
    raise KernelSignatureError("kernel-making macros nest too deeply")


def _in_define(text: str, at: int) -> bool:
    line = text[text.rfind("\n", 0, at) + 1:at]
    return line.lstrip().startswith("#")


_KERNEL = re.compile(r'extern\s+"C"\s+__global__\s+void\s+')


def parse_signatures(source: str, filename: str = "<source>") -> dict[str, Signature]:
    """Every extern "C" __global__ kernel of source (with its headers inlined: load_source)."""
    text = _strip_comments(source.replace("\\\n", " "))
    objects, functions = _macros(text)
    typedefs = {m.group(2): m.group(1).strip()
                for m in re.finditer(r"\btypedef\s+([\w\s]+?)\s+(\w+)\s*;", text)}
    body = "\n".join(line for line in _expand_kernel_macros(text, functions).splitlines()
                     if not line.lstrip().startswith("#"))
    out: dict[str, Signature] = {}
    for m in _KERNEL.finditer(body):
        i = m.end()
        lb = re.match(r"__launch_bounds__\s*\(", body[i:])
        if lb:
            i = _balanced(body, i + lb.end() - 1)
        nm = re.match(r"\s*(\w+)\s*\(", body[i:])
        if not nm:
            raise KernelSignatureError(f"{filename}: cannot read the kernel at {body[m.start():m.start() + 120]!r}")
        name = nm.group(1)
        open_at = i + nm.end() - 1
        plist = body[open_at + 1:_balanced(body, open_at) - 1]
        params = tuple(_param(p, name, filename, objects, typedefs)
                       for p in _split_top(plist) if p.strip() and p.strip() != "void")
        sig = Signature(name, filename, params)
        if name in out and out[name] != sig:
            raise KernelSignatureError(f"{filename}: kernel {name} is defined twice with different parameters")
        out[name] = sig
    return out


def _param(text: str, kernel: str, filename: str, objects: dict[str, str], typedefs: dict[str, str]) -> Param:
    where = f"{filename}: kernel {kernel}, parameter {text.strip()!r}"
    if "=" in text:
        raise KernelSignatureError(f"{where}: a default argument cannot be passed by a launch")
    decl = re.sub(r"\[\s*\]", "*", text)  # float x[] is a pointer
    pointer = "*" in decl or "&" in decl
    words = re.findall(r"\w+", decl)
    if len(words) < 2:
        raise KernelSignatureError(f"{where}: no parameter name")
    name, tokens = words[-1], words[:-1]
    for _ in range(8):  # object-like macros and typedefs may name a type
        expanded = []
        for t in tokens:
            sub = objects.get(t) if t in objects else typedefs.get(t)
            expanded += re.findall(r"\w+|\*", sub) if sub is not None else [t]
        if expanded == tokens:
            break
        tokens = expanded
    pointer = pointer or "*" in tokens
    base = " ".join(t for t in tokens if t not in _QUALIFIERS and t != "*")
    ctype = " ".join(t for t in words[:-1] if t not in _QUALIFIERS) + ("*" if pointer else "")
    if pointer:
        return Param(name, ctype, True, None)
    if base not in SCALAR_TYPES:
        raise KernelSignatureError(f"{where}: scalar type {base!r} is not one a launch can pass "
                                   f"({', '.join(sorted(SCALAR_TYPES))})")
    return Param(name, ctype, False, SCALAR_TYPES[base])


def file_signatures(filename: str) -> dict[str, Signature]:
    """The kernels of one file of ds4ref/hip/kernels, parsed as the runtime compiles it."""
    return parse_signatures(load_source(filename), filename)


def check_launch(kernel: Any, args: Sequence[Any]) -> None:
    """Check a launch of a runtime Kernel (anything with a `signature`); kernels made
    elsewhere (tests' fakes without one) pass unchecked."""
    sig = getattr(kernel, "signature", None)
    if sig is not None:
        sig.check(args)
