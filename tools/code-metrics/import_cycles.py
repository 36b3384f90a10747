#!/usr/bin/env python3
"""File-level imports inside crates, and the circles they form.

Usage: tools/code-metrics/import_cycles.py [CRATE_SRC...]
       (default: the sources of comera-run, comera-report and comera-train, each on its own)

A file imports a module when its code (comments and `#[cfg(test)]` modules left out) names
`crate::MODULE`. A directory module (`trainer/mod.rs` and its files) counts as one node: its
files' imports are its imports, and their `super::` references stay inside it. Prints each
module's imports, then every strongly connected component of more than one module (a circle:
each of its modules reaches every other), with the edges inside it.
"""
import os, re, sys

def strip_tests(text):
    # Drop `#[cfg(test)] mod … { … }` blocks by brace counting.
    out, i = [], 0
    for m in re.finditer(r'#\[cfg\(test\)\]\s*mod\s+\w+\s*\{', text):
        if m.start() < i:
            continue
        out.append(text[i:m.start()])
        depth, j = 1, m.end()
        while depth and j < len(text):
            depth += {'{': 1, '}': -1}.get(text[j], 0)
            j += 1
        i = j
    out.append(text[i:])
    return ''.join(out)

DEFAULT = ['crates/comera-run/src', 'crates/comera-report/src', 'crates/comera-train/src']

def main():
    srcs = sys.argv[1:] or DEFAULT
    total = 0
    for src in srcs:
        print(f'## {src}')
        total += crate(src)
        print()
    print(f'circles in all: {total}')

def crate(src):
    """Prints one crate's module imports and circles; returns the number of circles."""
    files = {}
    for root, _, names in os.walk(src):
        for n in names:
            if n.endswith('.rs'):
                p = os.path.join(root, n)
                rel = os.path.relpath(p, src)[:-3]
                mod = rel.replace(os.sep, '::')
                mod = mod[:-len('::mod')] if mod.endswith('::mod') else mod
                files[mod if mod not in ('lib', 'main') else 'lib'] = p
    top = {m.split('::')[0] for m in files if m != 'lib'}
    # Names the crate root re-exports (`pub use error::{Error, Result}`) stand for their module.
    reexport = {}
    lib = re.sub(r'//[^\n]*', '', open(files['lib'], encoding='utf-8').read())
    for module, names in re.findall(r'pub use (\w+)::\{([^}]*)\}', lib):
        for n in re.findall(r'\w+', names):
            reexport[n] = module
    for module, n in re.findall(r'pub use (\w+)::(\w+);', lib):
        reexport[n] = module
    def module_of(name):
        return name if name in top else reexport.get(name)
    edges = {m: set() for m in top}
    for mod, p in files.items():
        if mod == 'lib':
            continue
        text = strip_tests(open(p, encoding='utf-8').read())
        text = re.sub(r'//[^\n]*', '', text)
        node = mod.split('::')[0]
        named = re.findall(r'\bcrate::(\w+)', text)
        for group in re.findall(r'\bcrate::\{([^}]*)\}', text):
            named += re.findall(r'\b(\w+)\b', group)
        edges[node] |= {module_of(n) for n in named} - {None, node}
        edges[node] &= top
    for m in sorted(edges):
        if m != 'lib':
            print(f'{m}: {", ".join(sorted(edges[m])) or "-"}')
    # Tarjan's strongly connected components.
    index, low, stack, on, sccs, n = {}, {}, [], set(), [], [0]
    def visit(v):
        index[v] = low[v] = n[0]; n[0] += 1; stack.append(v); on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w); low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop(); on.discard(w); comp.append(w)
                if w == v: break
            sccs.append(sorted(comp))
    sys.setrecursionlimit(10000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    circles = [c for c in sccs if len(c) > 1]
    print(f'\ncircles: {len(circles)}')
    for c in circles:
        print(f'- {len(c)} modules: {", ".join(c)}')
        for v in c:
            inside = sorted(w for w in edges[v] if w in c)
            print(f'    {v} → {", ".join(inside)}')
    return len(circles)

if __name__ == '__main__':
    main()
