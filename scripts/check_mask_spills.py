#!/usr/bin/env python3
"""Looks in a built library for one known miscompilation of AVX-512 code:
an opmask register spilled to the stack narrowly (kmovw %k, slot: 16 bits)
and read back wider (e.g. mov slot, %ebx), so that the upper bits of the
value are whatever the slot held before.

gcc 12.2 did this in avx512_stats (src/kernels_avx512.c) when that file was
built with -fsanitize=null (at -O3 and at -O2): the 16-bit sign mask of a
16-column step came back with 16 stale bits on top, and the agreement
counts were wrong (docs/RELIABILITY.md, section 3). Our source converts each
mask to an unsigned int, which zero-extends it; the compiler's spill lost
that. The tests catch it only for the shapes they run, so this check reads
the whole machine code instead.

For every kmovb, kmovw or kmovd store of a mask register to a stack slot it
follows the function's listing on the store's fall-through path (through
calls and conditional jumps; it stops at an unconditional jump, a return,
ud2 and calls of functions that do not return), tracking which bytes of the
stack have been written since, and flags the first read that takes in any
byte of the mask together with a byte not written since the store (the
stale bytes), or that reads the mask with an instruction whose width it
cannot tell. One such read is accepted: a plain load of the mask into a
general register whose next use, on the same path, is a shift left of that
register (the same width) by enough to push the stale bits out, an and with
a mask no wider than the stored bits, or a zero extension of its low part
into itself. %rsp-relative slots follow push, pop and add/sub of %rsp. It
stops following a mask once a write of 4 bytes or more covers it (a narrower
write over it is followed on, as the mask was).

A heuristic: it does not follow jumps, so it can miss a read reached by
one. On the faulty object it reports the one read above and nothing else;
on the builds the project makes it reports none. It prints how many mask
stores to the stack it examined (gcc usually keeps masks in general
registers, so a clean build may have none).

Usage: check_mask_spills.py [--self-test] FILE...   (ELF files: objects, libraries)
Exit status: 0 clean, 1 a suspicious read found (or the self-test failed),
2 usage or tool error.
"""
import re
import shutil
import subprocess
import sys

INSN = re.compile(r"^\s*([0-9a-f]+):\s+(.*)$")
FUNC = re.compile(r"^[0-9a-f]+ <(.+)>:$")
MEM = re.compile(r"^(-?0x[0-9a-f]+|-?[0-9]+)?\((%rsp|%rbp)\)$")
PREFIXES = {"notrack", "bnd", "rep", "repz", "repe", "repnz", "repne", "lock", "data16",
            "cs", "ds", "es", "ss", "fs", "gs", "addr32"}
MASK_STORES = {"kmovb": 1, "kmovw": 2, "kmovd": 4}
NORETURN = re.compile(r"<(abort|_exit|exit|__stack_chk_fail|__assert_fail|__ubsan_handle_\w*_abort"
                      r"|__asan_report_\w+|__tsan_\w*abort\w*)(@plt)?(\+0x[0-9a-f]+)?>")
GPR = {}  # register name -> (family, bytes)
for fam, names in {"a": ("rax", "eax", "ax", "al"), "b": ("rbx", "ebx", "bx", "bl"),
                   "c": ("rcx", "ecx", "cx", "cl"), "d": ("rdx", "edx", "dx", "dl"),
                   "si": ("rsi", "esi", "si", "sil"), "di": ("rdi", "edi", "di", "dil"),
                   "bp": ("rbp", "ebp", "bp", "bpl"), "sp": ("rsp", "esp", "sp", "spl")}.items():
    for n, w in zip(names, (8, 4, 2, 1)):
        GPR["%" + n] = (fam, w)
    if fam in "abcd":
        GPR["%" + fam + "h"] = (fam, 1)
for i in range(8, 16):
    for suf, w in (("", 8), ("d", 4), ("w", 2), ("b", 1)):
        GPR["%%r%d%s" % (i, suf)] = ("r%d" % i, w)
# bytes read or written at the memory operand, by mnemonic
OP_BYTES = {"kmovb": 1, "kmovw": 2, "kmovd": 4, "kmovq": 8, "movzbl": 1, "movzbw": 1,
            "movzbq": 1, "movsbl": 1, "movsbw": 1, "movsbq": 1, "movzwl": 2, "movzwq": 2,
            "movswl": 2, "movswq": 2, "movslq": 4, "movb": 1, "movw": 2, "movl": 4, "movq": 8,
            "vmovd": 4, "vmovq": 8, "movd": 4, "vmovss": 4, "vmovsd": 8, "movss": 4,
            "movsd": 8, "vpbroadcastb": 1, "vpbroadcastw": 2, "vpbroadcastd": 4,
            "vpbroadcastq": 8, "vbroadcastss": 4, "vbroadcastsd": 8, "popcntw": 2}
VEC_BYTES = {"x": 16, "y": 32, "z": 64}
STORE_OPS = ("mov", "kmov", "vmov", "set")


def operands(args):
    """The operands of an AT&T instruction (commas inside parentheses or
    braces kept), without the trailing comment or symbol."""
    args = args.split("#")[0]
    args = re.sub(r"\s<[^>]*>\s*$", "", args)
    out, depth, cur = [], 0, ""
    for ch in args:
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
            continue
        depth += ch in "({"
        depth -= ch in ")}"
        cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def parse(listing):
    """[(function, [(address, mnemonic, operands, text)])] from objdump -d text
    (a name that appears twice stays two functions)."""
    funcs = []
    for line in listing.splitlines():
        m = FUNC.match(line)
        if m:
            funcs.append((m.group(1), []))
            continue
        m = INSN.match(line)
        if not m or not funcs:
            continue
        words = m.group(2).split(None, 1)
        while words and words[0] in PREFIXES:
            words = words[1].split(None, 1) if len(words) > 1 else []
        if not words:
            continue
        funcs[-1][1].append((m.group(1), words[0], operands(words[1] if len(words) > 1 else ""),
                             m.group(2)))
    return funcs


def mem_of(o):
    """(offset, base) of a plain stack operand (no index), else None."""
    m = MEM.match(re.sub(r"\{[^}]*\}$", "", o))
    return (int(m.group(1) or "0", 0), m.group(2)) if m else None


def access_bytes(op, ops, k):
    """Bytes the instruction reads or writes at memory operand k (None: unknown)."""
    if op in OP_BYTES:
        return OP_BYTES[op]
    bcast = re.search(r"\{1to([0-9]+)\}$", ops[k])
    vec = [VEC_BYTES[o[1]] for o in ops if re.match(r"^%[xyz]mm[0-9]+$", o)]
    if bcast and vec:
        return max(vec) // int(bcast.group(1))
    if op.startswith("set") and len(ops) == 1:
        return 1
    regs = [GPR[o][1] for j, o in enumerate(ops) if j != k and o in GPR]
    if regs and op not in ("shl", "shr", "sar", "rol", "ror", "sal"):
        return max(regs)
    if vec and op.startswith(("vmov", "mov", "vp", "v")):
        return max(vec)
    if op[-1:] in "bwlq" and re.match(r"^(cmp|test|add|sub|and|or|xor|inc|dec|neg|not|"
                                       r"shl|shr|sar|sal|mov|adc|sbb)[bwlq]$", op):
        return {"b": 1, "w": 2, "l": 4, "q": 8}[op[-1]]
    return None


def is_store(op, ops, k):
    return k == len(ops) - 1 and op.startswith(STORE_OPS) and (len(ops) >= 2 or
                                                               op.startswith("set"))


def ends_path(op, ops, text):
    return (op.startswith("jmp") or op.startswith("ret") or op in ("ud2", "hlt") or
            (op.startswith("call") and NORETURN.search(text) is not None))


def rsp_delta(op, ops):
    """Change of %rsp by this instruction (None: unknown change)."""
    if op in ("push", "pushq"):
        return -8
    if op in ("pop", "popq"):
        return 8
    if len(ops) == 2 and ops[1] == "%rsp":
        m = re.match(r"^\$(-?0x[0-9a-f]+|-?[0-9]+)$", ops[0])
        if op in ("sub", "subq") and m:
            return -int(m.group(1), 0)
        if op in ("add", "addq") and m:
            return int(m.group(1), 0)
        if op.startswith(("mov", "lea", "and")):
            return None
    return 0


def uses_family(ops, fam):
    return any(fam == GPR.get(r, (None,))[0] for o in ops for r in re.findall(r"%[a-z0-9]+", o))


def upper_bits_dropped(insns, j, reg, nbytes):
    """1 when, on the fall-through path after insns[j], the first instruction
    that mentions reg's family throws away every bit of reg above the low
    nbytes: shl $n of reg itself with n (mod its width) >= width - stored
    bits; and $imm of reg itself with imm < 2^(stored bits); movzwl/movzbl
    of its low part into its own 32-bit register, no wider than stored."""
    fam, width = GPR[reg]
    for _, op, ops, text in insns[j + 1:]:
        if ends_path(op, ops, text):
            return False
        if not uses_family(ops, fam):
            continue
        if re.match(r"^(shl|sal)[lq]?$", op) and len(ops) == 2 and ops[1] == reg:
            m = re.match(r"^\$(0x[0-9a-f]+|[0-9]+)$", ops[0])
            return bool(m) and int(m.group(1), 0) % (8 * width) >= 8 * (width - nbytes)
        if re.match(r"^and[lq]?$", op) and len(ops) == 2 and ops[1] == reg:
            m = re.match(r"^\$(0x[0-9a-f]+|[0-9]+)$", ops[0])
            return bool(m) and 0 <= int(m.group(1), 0) < (1 << (8 * nbytes))
        if op in ("movzwl", "movzbl") and len(ops) == 2 and ops[0] in GPR and ops[1] in GPR:
            src, dst = GPR[ops[0]], GPR[ops[1]]
            return src[0] == fam and dst == (fam, 4) and src[1] <= nbytes
        return False
    return False


def find(listing, name="input", counter=None):
    """Suspicious reads: lines of text, one each. counter, a list, gets the
    number of mask stores to the stack examined added to its first item."""
    found = []
    for func, insns in parse(listing):
        for i, (addr, op, ops, _) in enumerate(insns):
            if op not in MASK_STORES or len(ops) != 2 or not re.match(r"^%k[0-7]$", ops[0]):
                continue
            slot = mem_of(ops[1])
            if slot is None:
                continue
            if counter is not None:
                counter[0] += 1
            base, nb = slot[1], MASK_STORES[op]
            mask = set(range(slot[0], slot[0] + nb))  # the mask's bytes
            fresh = set(mask)                          # bytes written since the store
            delta = 0                                  # %rsp moved since the store
            for j in range(i + 1, len(insns)):
                addr2, op2, ops2, text2 = insns[j]
                if ends_path(op2, ops2, text2) or not mask:
                    break
                hits = []
                for k, o in enumerate(ops2):
                    mo = mem_of(o)
                    if mo and mo[1] == base:
                        off = mo[0] + (delta if base == "%rsp" else 0)
                        hits.append((k, off))
                verdict = None
                for k, off in hits:
                    if op2.startswith("lea") or op2.startswith("prefetch"):
                        continue
                    w = access_bytes(op2, ops2, k)
                    span = set(range(off, off + (w or 64)))
                    if is_store(op2, ops2, k):
                        if w is None:
                            w = 8
                            span = set(range(off, off + 8))
                        fresh |= span
                        if w >= 4 and mask <= span:
                            mask = set()  # written over whole: a value of its own
                        continue
                    if not span & mask:
                        continue
                    stale = span - fresh
                    if w is None:
                        verdict = "width unknown"
                    elif stale:
                        low_load = (op2.startswith("mov") and len(ops2) == 2 and k == 0 and
                                    ops2[1] in GPR and off == min(mask) and
                                    min(stale) >= off + nb)
                        if not (low_load and upper_bits_dropped(insns, j, ops2[1], nb)):
                            verdict = "%d bytes, %d not written since" % (w, len(stale))
                if verdict:
                    found.append("%s: %s: %s %s at %s, then %s %s at %s (%s)" % (
                        name, func, op, ",".join(ops), addr, op2, ",".join(ops2), addr2,
                        verdict))
                    break
                if base == "%rsp":
                    d = rsp_delta(op2, ops2)
                    if d is None:
                        break  # %rsp set in a way this does not follow
                    delta += d
    return found


def _listing(*insns):
    return "0000000000000000 <f>:\n" + "".join("  %x:\t%s\n" % (4 * i, s)
                                                for i, s in enumerate(insns))


# (expected to be flagged, listing): the fault as gcc emitted it, the reads
# that must be flagged, and correct code that must not be.
SELF_TESTS = [
    (True, _listing("kmovw  %k2,-0x5b0(%rbp)", "vmulps %zmm1,%zmm1,%zmm1",
                    "mov    -0x5b0(%rbp),%ebx", "popcnt %ebx,%eax")),
    (True, _listing("kmovw %k2,-0x40(%rbp)", "popcnt -0x40(%rbp),%ebx", "and $0x1,%ebx")),
    (True, _listing("kmovw %k2,-0x40(%rbp)", "cmp -0x40(%rbp),%rdx", "jne 80 <f+0x80>",
                    "shl $0x30,%rdx")),
    (True, _listing("kmovw %k2,-0x40(%rbp)", "mov -0x40(%rbp),%edx", "shl $0x10,%dl",
                    "popcnt %edx,%eax")),
    (True, _listing("kmovw %k2,-0x40(%rbp)", "mov -0x40(%rbp),%rdx", "shl $0x50,%rdx")),
    (True, _listing("kmovw %k2,-0x40(%rbp)", "mov -0x40(%rbp),%edx", "movzwl %dx,%eax",
                    "popcnt %edx,%ecx")),
    (True, _listing("kmovw %k2,-0x40(%rbp)", "mov -0x40(%rbp),%rdx",
                    "mov (%rax,%rdx,4),%ecx", "shl $0x30,%rdx")),
    (True, _listing("kmovw %k2,-0x40(%rbp)", "vmovq -0x40(%rbp),%xmm0", "and $0x1,%eax")),
    (True, _listing("kmovw %k2,-0x40(%rbp)", "movb $0x0,-0x40(%rbp)",
                    "mov -0x40(%rbp),%ebx")),
    (True, _listing("kmovw %k2,-0x40(%rbp)", "mov %ax,-0x40(%rbp)",
                    "mov -0x40(%rbp),%ebx")),
    (True, _listing("kmovw %k2,-0x40(%rbp)", "movzwl -0x3f(%rbp),%ebx")),
    (True, _listing("kmovw %k2,-0x40(%rbp)", "mov -0x44(%rbp),%rbx")),
    (True, _listing("kmovw %k2,-0x40(%rbp)", "vpandd -0x40(%rbp){1to16},%zmm1,%zmm0")),
    (True, _listing("kmovw %k2,0x8(%rsp)", "push %rbx", "mov 0x10(%rsp),%ebx")),
    (True, _listing("kmovw %k2,(%rsp)", "mov 0x0(%rsp),%ebx")),
    (True, _listing("kmovw %k2,-0x40(%rbp)", "mov -0x40(%rbp),%rdx", "shl %cl,%rdx")),
    (True, _listing("kmovd %k2,-0x40(%rbp)", "mov -0x40(%rbp),%rdx", "popcnt %rdx,%rax")),
    (True, _listing("kmovw %k2,-0x40(%rbp)", "mov -0x40(%rbp),%r8d")),
    (False, _listing("kmovw %k2,-0x40(%rbp)", "kmovw -0x40(%rbp),%k3")),
    (False, _listing("kmovw %k1,0x10(%rsp)", "movzwl 0x10(%rsp),%eax")),
    (False, _listing("kmovw %k4,-0x48(%rbp)", "mov %rax,-0x48(%rbp)", "mov -0x48(%rbp),%rdx")),
    (False, _listing("kmovw %k0,0x700(%rsp)", "call 3070 <__tsan_write_range@plt>",
                     "mov 0x700(%rsp),%rdx", "movzwl 0x6c0(%rsp),%eax", "shl $0x30,%rdx")),
    (False, _listing("kmovw %k2,-0x40(%rbp)", "mov -0x40(%rbp),%edx", "and $0xffff,%edx",
                     "popcnt %edx,%eax")),
    (False, _listing("kmovw %k5,-0x80(%rbp)", "jmp 90 <f+0x90>", "vmovaps -0x80(%rbp),%zmm1")),
    (False, _listing("kmovw %k2,-0x40(%rbp)", "notrack jmp *%rax", "mov -0x40(%rbp),%ebx")),
    (False, _listing("kmovw %k2,-0x40(%rbp)", "rep ret", "mov -0x40(%rbp),%ebx")),
    (False, _listing("kmovw %k2,-0x40(%rbp)", "ud2", "mov -0x40(%rbp),%ebx")),
    (False, _listing("kmovw %k2,-0x40(%rbp)",
                     "call 100 <__ubsan_handle_type_mismatch_v1_abort>", "mov -0x40(%rbp),%ebx")),
    (False, _listing("kmovw %k2,0x8(%rsp)", "mov 0x8(%rsp,%rax,1),%ebx")),
    (False, _listing("kmovw %k2,0x10(%rsp)", "mov -0x10(%rbp),%ebx")),
    (False, _listing("kmovw %k2,-0x40(%rbp)", "mov 0x2000(%rip),%rax        # 3000 <x>",
                     "lea -0x40(%rbp),%rdi", "movzbq -0x40(%rbp),%rax",
                     "vpbroadcastw -0x40(%rbp),%zmm0", "kmovw -0x40(%rbp),%k1")),
    (False, _listing("kmovb %k2,-0x40(%rbp)", "sete -0x40(%rbp)", "movzbl -0x40(%rbp),%eax")),
    (False, "0000000000000000 <s.part.0>:\n  0:\tkmovw %k1,-0x40(%rbp)\n"
            "  4:\tkmovw -0x40(%rbp),%k2\n  8:\tcall 1 <abort>\n"
            "0000000000000100 <s.part.0>:\n  100:\tmov -0x40(%rbp),%ebx\n"),
]


def self_test():
    wrong = []
    for n, (bad, text) in enumerate(SELF_TESTS):
        got = find(text, "case %d" % n)
        if bool(got) != bad:
            wrong.append("case %d: expected %s, got %r" % (n, "flagged" if bad else "clean",
                                                           got))
    if wrong:
        print("check_mask_spills: self-test FAILED:\n  " + "\n  ".join(wrong))
        return False
    print("check_mask_spills: self-test passed (%d listings: %d faulty ones flagged, %d "
          "correct ones not)" % (len(SELF_TESTS), sum(b for b, _ in SELF_TESTS),
                                 sum(not b for b, _ in SELF_TESTS)))
    return True


def main(argv):
    usage = "usage: check_mask_spills.py [--self-test] FILE...  (ELF objects or libraries)"
    opts = [a for a in argv if a.startswith("-")]
    files = [a for a in argv if not a.startswith("-")]
    if any(o != "--self-test" for o in opts) or not (files or opts):
        print(usage, file=sys.stderr)
        return 2
    if opts and not self_test():
        return 1
    if not files:
        return 0
    objdump = shutil.which("objdump")
    if objdump is None:
        print("check_mask_spills: objdump not found (binutils)", file=sys.stderr)
        return 2
    found, count = [], [0]
    for f in files:
        r = subprocess.run([objdump, "-d", "--no-show-raw-insn", "--", f], capture_output=True,
                           text=True)
        if r.returncode != 0:
            print("check_mask_spills: objdump failed on %s: %s" % (
                f, r.stderr.strip() or "exit status %d" % r.returncode), file=sys.stderr)
            return 2
        found += find(r.stdout, f, count)
    for line in found:
        print("SUSPICIOUS: " + line)
    print("check_mask_spills: %d mask store(s) to the stack examined, %d suspicious read(s), "
          "in %s" % (count[0], len(found), " ".join(files)))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
