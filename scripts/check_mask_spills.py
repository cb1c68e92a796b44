#!/usr/bin/env python3
"""Looks in a built library for one known miscompilation of AVX-512 code:
an opmask register spilled to the stack 16 bits wide (kmovw %k, slot) and
read back wider (e.g. mov slot, %ebx), so that the upper bits of the value
are whatever the slot held before.

gcc 12.2 did this in avx512_stats (src/kernels_avx512.c) when that file was
built at -O3 with -fsanitize=null: the 16-bit sign mask of a 16-column step
came back with 16 stale bits on top, and the agreement counts were wrong
(docs/RELIABILITY.md, section 3). Our source converts each mask to an
unsigned int, which zero-extends it; the compiler's spill lost that. The
tests catch it only for the shapes they run, so this check reads the whole
machine code instead: for every kmovw, kmovb or kmovd store to a stack slot, the
next instruction on its fall-through path that touches the slot must either
overwrite it or read it at most as wide as it was stored (or read it wider
into a register whose next use drops the upper bits: a shift left that far,
a zero extension, an and with a small mask). That is a heuristic (it does
not follow jumps), so it can miss a case; on the faulty build it found the
one above and nothing else, and on the builds the project makes it finds
nothing.

Usage: check_mask_spills.py [--self-test] FILE...   (ELF files: objects, libraries)
Exit status: 0 clean, 1 a suspicious spill found, 2 usage or tool error.
"""
import re
import shutil
import subprocess
import sys

SLOT = re.compile(r"(-?0x[0-9a-f]+)?\((%rsp|%rbp)\)")
INSN = re.compile(r"^\s*([0-9a-f]+):\s+(\S+)\s*(.*)$")
FUNC = re.compile(r"^[0-9a-f]+ <(.+)>:$")
NARROW_STORES = {"kmovd": 32, "kmovw": 16, "kmovb": 8}
REG_WIDTH = [(re.compile(r"^%r(?:[a-d]x|[sd]i|[sb]p|[0-9]+)$"), 64),
             (re.compile(r"^%(?:e[a-d]x|e[sd]i|e[sb]p|r[0-9]+d)$"), 32),
             (re.compile(r"^%(?:[a-d]x|[sd]i|[sb]p|r[0-9]+w)$"), 16),
             (re.compile(r"^%(?:[a-d]l|[sd]il|[sb]pl|r[0-9]+b|[a-d]h)$"), 8)]
OP_WIDTH = {"kmovb": 8, "kmovw": 16, "kmovd": 32, "kmovq": 64, "movzbl": 8, "movzbw": 8,
            "movsbl": 8, "movsbw": 8, "movzwl": 16, "movzwq": 16, "movswl": 16,
            "movswq": 16, "movw": 16, "movb": 8, "vmovd": 32, "vmovq": 64, "movl": 32,
            "movq": 64, "vmovss": 32, "vmovsd": 64}


def operands(args):
    """The operands of an AT&T instruction (commas inside parentheses kept)."""
    out, depth, cur = [], 0, ""
    for ch in args.split("#")[0]:
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
            continue
        depth += ch == "("
        depth -= ch == ")"
        cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def width(op, ops):
    """Bits an instruction reads or writes at its memory operand (None: unknown)."""
    if op in OP_WIDTH:
        return OP_WIDTH[op]
    for o in ops:
        for rx, w in REG_WIDTH:
            if rx.match(o):
                return w
        if o.startswith("%k"):
            return None
    if op[-1:] in ("b", "w", "l", "q") and op[:-1] in ("cmp", "test", "add", "sub", "and",
                                                           "or", "xor", "inc", "dec"):
        return {"b": 8, "w": 16, "l": 32, "q": 64}[op[-1]]
    return None


def parse(listing):
    """{function: [(address, op, operands)]} from objdump -d text."""
    funcs, cur = {}, None
    for line in listing.splitlines():
        m = FUNC.match(line)
        if m:
            cur = funcs.setdefault(m.group(1), [])
            continue
        m = INSN.match(line)
        if m and cur is not None:
            cur.append((m.group(1), m.group(2), operands(m.group(3))))
    return funcs


def slot_of(o):
    m = SLOT.fullmatch(o)
    return (int(m.group(1) or "0", 16), m.group(2)) if m else None


def reg_family(r):
    """A name shared by a general register and its parts (%rax, %eax, %ax, %al)."""
    m = re.match(r"^%r([0-9]+)[dwb]?$", r)
    if m:
        return "r" + m.group(1)
    m = re.match(r"^%[re]?([a-d])[xlh]$|^%[re]?([sd]i|[sb]p)l?$", r)
    return (m.group(1) or m.group(2)) if m else None


def upper_bits_dropped(insns, j, reg, bits, stored):
    """1 when the first use of reg after insns[j] throws away every bit above
    the stored width: shl by at least (register width - stored), a 16- or
    8-bit zero extension of its low part, or an and with a mask that fits."""
    fam = reg_family(reg)
    for _, op, ops in insns[j + 1:]:
        uses = [o for o in ops if reg_family(o) == fam]
        if not uses:
            continue
        if op.startswith("shl") and len(ops) == 2 and ops[0].startswith("$"):
            return int(ops[0][1:], 0) >= bits - stored
        if op in ("movzwl", "movzwq", "movzbl", "movzbq") and reg_family(ops[0]) == fam:
            return (8 if op.startswith("movzb") else 16) <= stored
        if op.startswith("and") and len(ops) == 2 and ops[0].startswith("$"):
            return int(ops[0][1:], 0) < (1 << stored)
        return False
    return False


def find(listing, name="input"):
    """Suspicious spills: lines of text, one each. From each narrow mask
    store the listing is followed on its fall-through path (through calls
    and conditional jumps, up to an unconditional jump or a return) to the
    next instruction that touches the slot."""
    found = []
    for func, insns in parse(listing).items():
        for i, (addr, op, ops) in enumerate(insns):
            if op not in NARROW_STORES or len(ops) != 2 or not ops[0].startswith("%k"):
                continue
            slot = slot_of(ops[1])
            if slot is None:
                continue
            stored = NARROW_STORES[op]
            for j in range(i + 1, len(insns)):
                addr2, op2, ops2 = insns[j]
                if op2.startswith(("jmp", "ret")):
                    break
                hit = [k for k, o in enumerate(ops2) if slot_of(o) == slot]
                if not hit:
                    continue
                is_store = hit[-1] == len(ops2) - 1 and len(ops2) >= 2 and (
                    op2.startswith(("mov", "kmov", "vmov")) or op2.startswith("set"))
                if is_store:
                    break  # overwritten before any read
                w = width(op2, ops2)
                if w is not None and w > stored and len(ops2) == 2 and hit == [0]:
                    if upper_bits_dropped(insns, j, ops2[1], w, stored):
                        w = stored  # e.g. mov slot,%rdx; shl $0x30,%rdx
                if w is None or w > stored:
                    found.append("%s: %s: %s %s at %s, then %s %s at %s (%s bits)" % (
                        name, func, op, ",".join(ops), addr, op2, ",".join(ops2), addr2,
                        "unknown" if w is None else w))
                break
    return found


SELF_TEST_BAD = """
0000000000000000 <f>:
   0:	kmovw  %k2,-0x5b0(%rbp)
   9:	vmulps %zmm1,%zmm1,%zmm1
   f:	mov    -0x5b0(%rbp),%ebx
  15:	popcnt %ebx,%eax
"""
SELF_TEST_GOOD = """
0000000000000000 <g>:
   0:	kmovw  %k2,-0x40(%rbp)
   9:	kmovw  -0x40(%rbp),%k3
  10:	kmovw  %k1,0x10(%rsp)
  17:	movzwl 0x10(%rsp),%eax
  1c:	kmovw  %k4,-0x48(%rbp)
  25:	mov    %rax,-0x48(%rbp)
  29:	mov    -0x48(%rbp),%rdx
  2d:	kmovw  %k0,0x700(%rsp)
  36:	call   3070 <__tsan_write_range@plt>
  3b:	mov    0x700(%rsp),%rdx
  43:	movzwl 0x6c0(%rsp),%eax
  4b:	shl    $0x30,%rdx
  4f:	kmovw  %k5,-0x80(%rbp)
  58:	jmp    90 <g+0x90>
  5a:	vmovaps -0x80(%rbp),%zmm1
"""


def self_test():
    bad, good = find(SELF_TEST_BAD, "bad"), find(SELF_TEST_GOOD, "good")
    if len(bad) != 1 or good:
        print("check_mask_spills: self-test FAILED: bad listing gave %r, good gave %r"
              % (bad, good))
        return False
    print("check_mask_spills: self-test passed (the known-bad listing is flagged, the good one is not)")
    return True


def main(argv):
    files = [a for a in argv if a != "--self-test"]
    if "--self-test" in argv and not self_test():
        return 1
    if not files:
        return 0 if "--self-test" in argv else 2
    objdump = shutil.which("objdump")
    if objdump is None:
        print("check_mask_spills: objdump not found (binutils)", file=sys.stderr)
        return 2
    found = []
    for f in files:
        r = subprocess.run([objdump, "-d", "--no-show-raw-insn", f], capture_output=True,
                           text=True)
        if r.returncode != 0:
            print("check_mask_spills: objdump failed on %s: %s" % (f, r.stderr.strip()),
                  file=sys.stderr)
            return 2
        found += find(r.stdout, f)
    for line in found:
        print("SUSPICIOUS: " + line)
    print("check_mask_spills: %d suspicious mask spill(s) in %s" % (len(found), " ".join(files)))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
