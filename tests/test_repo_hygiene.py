"""Repository hygiene: every tracked text file speaks of the project only.

A tracked file must not carry run numbers of the project's own work log, issue numbers of this project (another
project's issue is cited as owner/repo#N or by URL, which passes), absolute paths of the machine a file was made on
(home, scratch or checkout directories: results record paths relative to the repository, or a package's file
name), or words about how machines were obtained and who did the work. RULES holds the patterns; CAUGHT and PASSES
show what each catches and what it lets through, with a "|" inside each forbidden word so that this file passes
its own scan.
README.md is at most 200 lines (its own test, so that failure stands apart), and benchmarks/results holds results
only: no resume caches, every file listed in benchmarks/README.md.
"""

import re
import subprocess
from bisect import bisect_right
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 200
BINARY_SUFFIXES = {".png", ".jpg", ".jpeg", ".gif", ".pdf", ".so", ".a", ".o", ".onnx", ".gguf", ".safetensors",
                   ".bin", ".engine", ".plan", ".npz", ".npy", ".pt", ".gz", ".zip", ".whl"}

ALNUM = "abcdefghijklmnopqrstuvwxyz0123456789"
PATHY = ALNUM + "_.~/$-"  # before a path that is relative (build/tmp/x, ./tmp), a variable's ($TMPDIR/x) or a URL's
# (rule, pattern, characters that may not precede a match). Patterns run on the lower-cased text and each starts with
# a literal, so a scan of the whole repository stays well under a second. CAUGHT below shows what each one catches;
# the (?:...) groups keep the patterns' own text from matching them.
RULES = [
    # a run number: the word, an optional space, dash or underscore, digits; not "stop words", "stop strings", "stop="
    ("run number", r"stops?[ _-]?\d+", ALNUM),
    # an issue number, also inside a test name; not an instruction's issue rate ("each issue 1 per cycle")
    ("issue number", r"issues?[ _-]?#?\d+(?!\s*per\b)", ALNUM),
    # a bare hash and number; owner/repo#N follows a word character, a C token paste a hash, an HTML entity a "&"
    ("issue number", r"#\d+\b", ALNUM + "_/.#&-"),
    # an absolute path under a home, scratch or checkout directory
    ("machine path", r"/(?:work|root|tmp|scratch|workspace|mnt)\b", PATHY),
    ("machine path", r"/(?:home)/[\w.-]+", PATHY),
    # how machines were obtained, the files that told, and who did the work
    *[("hardware or team talk", rx, ALNUM) for rx in (
        r"(?:le)nt\b", r"device (?:tool|time|machine)s?\b", r"(?:work)place\b", r"gpu (?:windows?)\b",
        r"drawn (?:by) chance\b", *(name + r"\.md\b" for name in ("kinds", "method", "hopper", "h100", "h200", "rules")),
        r"(?:engi)neers?\b")],
    ("hardware or team talk", r"\.(?:library)/", ""),
]
PATTERNS = [(name, re.compile(rx), set(before)) for name, rx, before in RULES]
URL = re.compile(r"https?://\S+")  # another project's issue or PR is cited by its URL (or as owner/repo#N)


def hits(text: str) -> list[tuple[int, str, str]]:
    """(line number, rule, matched text) of every forbidden span of `text`, in order."""
    low = text.lower()
    if len(low) != len(text):  # a character whose lower case is longer: lower-case ASCII only
        low = text.translate(str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", ALNUM[:26]))
    urls = [m.span() for m in URL.finditer(low)]
    starts = [0] + [m.end() for m in re.finditer("\n", low)]
    found = []
    for name, rx, before in PATTERNS:
        for m in rx.finditer(low):
            a = m.start()
            if (a and low[a - 1] in before) or any(u0 <= a < u1 for u0, u1 in urls):
                continue
            found.append((bisect_right(starts, a), name, text[a:m.end()]))
    return sorted(found)


def tracked_files() -> list[str]:
    """`git ls-files`: every tracked path relative to the repository."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"git ls-files is unavailable here ({e}): the hygiene checks need a git checkout")
    return [rel for rel in out.decode().split("\0") if rel]


def tracked_text_files() -> dict[str, str]:
    """Every tracked file that is text (no binary suffix, no NUL byte), by path relative to the repository."""
    files = {}
    for rel in tracked_files():
        path = ROOT / rel
        if Path(rel).suffix.lower() in BINARY_SUFFIXES or not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" not in data[:8192]:
            files[rel] = data.decode("utf-8", errors="replace")
    return files


# ----------------------------------------------------------------------------------------------- the checker

# A "|" splits each forbidden word, so this file passes its own scan; the tests remove it.
CAUGHT = [  # (synthetic line, rule that must catch it)
    ("// until st|op 31 F was found per group", "run number"),
    ("KIVI-2 took 60 ms (st|op 38: 62.9-66.0)", "run number"),
    ("The attempts of st|ops 21-29 are listed", "run number"),
    ("St|op 38's kernel, be4501b", "run number"),
    ("the st|op-39 table", "run number"),
    ("def test_scores_of_st|op_39():", "run number"),
    ("on the Intel Xeon, st|op39", "run number"),
    ("FORMAT_VERSION = 3  # 2: sink_tokens (iss|ue 11)", "issue number"),
    ("Iss|ue 12's budget follows from this table", "issue number"),
    ("as in iss|ues 11 and 13", "issue number"),
    ("see iss|ue-12", "issue number"),
    ("def test_waves_of_iss|ue_12():", "issue number"),
    ("eval_speed_iss|ue13.json", "issue number"),
    ("the tree iss|ue #|13 was filed against", "issue number"),
    ("fixed in #|12", "issue number"),
    ("(see #|14)", "issue number"),
    ('"library": "/wo|rk/main/.venv/lib/libkivi.so"', "machine path"),
    ("git worktree add /wo|rk/wt/old ac7eb69", "machine path"),
    ("cd /ro|ot/llama.cpp", "machine path"),
    ("/ho|me/alice/models/x.gguf", "machine path"),
    ("g++ -O2 -o /t|mp/strided x.cpp", "machine path"),
    ("base=/t|mp/a.so", "machine path"),
    ("mkdir -p /scr|atch/llama", "machine path"),
    ("Measured on a le|nt H200", "hardware or team talk"),
    ("copy bandwidth of KIN|DS.md", "hardware or team talk"),
    ("see METH|OD.md and HOP|PER.md", "hardware or team talk"),
    ("Sources: .lib|rary/device/H2|00.md", "hardware or team talk"),
    ("without dev|ice time", "hardware or team talk"),
    ("the work|place's reference copy", "hardware or team talk"),
    ("owned by the plugin engi|neer", "hardware or team talk"),
    ("tokens from the model engi|neer's runtime", "hardware or team talk"),
    ("only some GPU win|dows, dra|wn by chance", "hardware or team talk"),
]

PASSES = [  # allowed forms: none of these may be reported
    "stop words and stop strings end a request: stop=['\\n'], stop_token_ids=[2]",
    "the server's stop() signals its process group; stops at the first stop string",
    "Request(stop=[], max_tokens=16)  # stop 'strings', not numbers",
    "a non-stop run; stopping after 3 tokens; unstoppable 4",
    "see NVIDIA/TensorRT#4011 and ggml-org/llama.cpp#12345",
    "https://github.com/huggingface/transformers/issues/30000 and https://github.com/a/b/pull/12",
    "vpdpwssd and vdpbf16ps each issue 1 per cycle; 880 issue slots per tile; the issue rate",
    "a##S##00, a##M0##0  // token pastes; #define KIVI_X 1; #if 0",
    "results/bench_kernels_h200.json; build/tmp/x; ./tmp/y; $TMPDIR/z; ~/models; https://example.com/home/x",
    "tmp_path / 'x.json'; tempfile.mkdtemp(); os.path.join(tmp, 'a')",
    "keys drawn from a seeded RNG; the lentil soup; a sleeping device; the GPU's time; prompt engineering",
    "libkivi_cpu.so; benchmarks/results/cpu_attention_op_xeon.json",
]


@pytest.mark.parametrize(("line", "rule"), CAUGHT)
def test_checker_catches(line, rule):
    text = "first line\n" + line.replace("|", "") + "\n"
    found = hits(text)
    assert found and {(n, r) for n, r, _ in found} == {(2, rule)}, found


@pytest.mark.parametrize("line", PASSES)
def test_checker_lets_allowed_forms_pass(line):
    assert hits(line) == []


def test_checker_reports_every_hit_with_its_line_and_text():
    text = "ok\nfixed in st|op 3, see iss|ue 4\nok\n/wo|rk/main/x\n".replace("|", "")
    want = [(2, "issue number", "iss|ue 4"), (2, "run number", "st|op 3"), (4, "machine path", "/wo|rk")]
    assert hits(text) == [(n, rule, t.replace("|", "")) for n, rule, t in want]


# ----------------------------------------------------------------------------------------------- the repository

def test_tracked_files_speak_of_the_project_only():
    """Every tracked text file's content, and every tracked path (a file name may carry a number too)."""
    bad = [f"{rel}:{n}: {rule}: {text!r}" for rel, content in sorted(tracked_text_files().items())
           for n, rule, text in hits(content)]
    bad += [f"{rel}: file name: {rule}: {text!r}" for rel in tracked_files() for _, rule, text in hits(rel)]
    assert not bad, f"{len(bad)} hygiene hits:\n" + "\n".join(bad)


def test_readme_is_at_most_200_lines():
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines; at most {README_MAX_LINES} (details belong in docs/)"


def test_results_hold_results_only():
    """benchmarks/results: no resume caches; every file is listed in benchmarks/README.md (what made it, where)."""
    files = [rel for rel in tracked_files() if rel.startswith("benchmarks/results/")]
    caches = [rel for rel in files if rel.endswith(".cache.jsonl")]
    assert not caches, f"resume caches are not results: {caches}"
    index = (ROOT / "benchmarks" / "README.md").read_text()
    # a Markdown report next to its JSON is listed with it ("x.json, .md")
    unlisted = [rel for rel in files if Path(rel).name not in index
                and not (rel.endswith(".md") and Path(rel).with_suffix(".json").name in index)]
    assert not unlisted, f"not listed in benchmarks/README.md: {unlisted}"
