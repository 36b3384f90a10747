#!/usr/bin/env python3
"""Lines of each `fn` body in crates/*/src, tests excluded (issue 30's measure).

Usage: tools/code-metrics/fn_lengths.py [ROOT] [--top N] [--crate NAME]...
Prints the longest functions and how many run over 60 and 100 lines. A body is counted from
the line of `fn` to its closing brace; `#[cfg(test)]` modules and `tests/` are skipped.
"""
import os, re, sys

def strip(line):
    # Drop string/char literals and line comments so braces inside them are not counted.
    line = re.sub(r'"(\\.|[^"\\])*"', '""', line)
    line = re.sub(r"'(\\.|[^'\\])'", "''", line)
    i = line.find('//')
    return line if i < 0 else line[:i]

def functions(path):
    lines = open(path, encoding='utf-8').read().split('\n')
    out, i, n = [], 0, len(lines)
    skip_depth = None
    depth = 0
    pending_test = False
    stack = []  # (name, start, depth_at_open)
    for i, raw in enumerate(lines):
        s = strip(raw)
        if re.match(r'\s*#\[cfg\(test\)\]', raw):
            pending_test = True
        m = re.search(r'\bfn\s+([A-Za-z_][A-Za-z0-9_]*)', s)
        opens, closes = s.count('{'), s.count('}')
        if skip_depth is None and pending_test and re.match(r'\s*(pub\s+)?mod\s', s) and opens:
            skip_depth = depth
        if re.match(r'\s*(pub\s+)?mod\s', s) is None and s.strip() and not s.strip().startswith('#'):
            if not re.match(r'\s*(pub\s+)?mod\s', s):
                pending_test = pending_test and not s.strip()
        if m and skip_depth is None:
            stack.append([m.group(1), i, depth, False])
        for ch in s:
            if ch == '{':
                depth += 1
                if stack and not stack[-1][3] and stack[-1][2] == depth - 1:
                    stack[-1][3] = True
            elif ch == '}':
                depth -= 1
                if stack and stack[-1][3] and depth == stack[-1][2]:
                    name, start, _, _ = stack.pop()
                    out.append((i - start + 1, name, start + 1))
                if skip_depth is not None and depth == skip_depth:
                    skip_depth = None
            elif ch == ';' and stack and not stack[-1][3] and stack[-1][2] == depth:
                stack.pop()  # a declaration without a body (trait method)
    return out

def main():
    args = sys.argv[1:]
    top, crates, root = 15, [], '.'
    while args:
        a = args.pop(0)
        if a == '--top': top = int(args.pop(0))
        elif a == '--crate': crates.append(args.pop(0))
        else: root = a
    rows = []
    cdir = os.path.join(root, 'crates')
    for c in sorted(os.listdir(cdir)):
        if crates and c not in crates: continue
        for d, _, fs in os.walk(os.path.join(cdir, c, 'src')):
            for f in fs:
                if f.endswith('.rs'):
                    p = os.path.join(d, f)
                    for ln, name, start in functions(p):
                        rows.append((ln, name, os.path.relpath(p, root), start))
    rows.sort(reverse=True)
    for ln, name, p, start in rows[:top]:
        print(f'{ln:5} {p}:{start} {name}')
    print(f'functions: {len(rows)}, over 100 lines: {sum(r[0] > 100 for r in rows)}, over 60 lines: {sum(r[0] > 60 for r in rows)}')

main()
