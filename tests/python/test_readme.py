"""Every fenced code block in README.md is checked, so the README cannot drift from the software.

- ```python blocks run as written, each as its own script in a fresh process (working directory: a temporary
  folder), and must exit with status 0.
- ```bash / ```sh blocks build and install, so they are not run. Each command line must name things that
  exist: repository paths (scripts, examples, ...), the options it passes to a repository script or to
  ``python -m`` module, environment switches (they must appear in the build or the sources), packages it
  pip-installs (they must be in requirements.txt or pyproject.toml), and a known command.
- ```cmake blocks must use find_package(fastmha) and fastmha::fastmha.
- ```cpp blocks must include headers that exist (torch's include dirs, csrc/include, the system's) and name
  fastmha:: symbols that the public headers declare. Compiling is left to test_cpp_package.py, which builds
  examples/cpp/*.
- Blocks tagged ``text`` or without a tag are output and are not run; neither is a block whose previous
  non-blank line is ``<!-- not-run -->``. Any other tag fails the test, so a new kind of block is a decision.

Also: relative links and images in README.md and docs/*.md resolve, and the README names nothing outside the
repository.
"""

import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from readme_blocks import README, Block, extract_blocks

ROOT = Path(__file__).resolve().parents[2]

OUTPUT_TAGS = {"", "text"}
SHELL_TAGS = {"bash", "sh"}
CPP_TAGS = {"cpp", "c++"}
KNOWN_TAGS = OUTPUT_TAGS | SHELL_TAGS | CPP_TAGS | {"python", "cmake"}


BLOCKS = extract_blocks(README.read_text(encoding="utf-8"))


def blocks_of(tags):
    chosen = [block for block in BLOCKS if block.tag in tags and not block.not_run]
    return pytest.mark.parametrize("block", chosen, ids=[f"line{block.line}" for block in chosen])


# ---- python ----


def run_python(block, directory):
    script = directory / f"readme_line{block.line}.py"
    script.write_text(block.code, encoding="utf-8")
    return subprocess.run([sys.executable, str(script)], cwd=directory, capture_output=True, text=True, timeout=300)


# ---- shell ----

# Top-level folders of the repository's sources: a path into one of them must exist.
SOURCE_DIRS = {"benchmarks", "cmake", "csrc", "docs", "examples", "python", "scripts", "tests"}
COMMANDS = {"bash", "sh", "pip", "pip3", "python", "python3", "cmake", "ctest", "source", "export", "cd"}
ASSIGNMENT = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=")


def read_all(paths):
    return "\n".join(path.read_text(encoding="utf-8", errors="replace") for path in paths if path.is_file())


def switch_sources():
    """Where an environment switch a README command sets must appear: the build and the sources."""
    paths = [ROOT / "setup.py", ROOT / "CMakeLists.txt", *(ROOT / "cmake").rglob("*"), *(ROOT / "scripts").rglob("*"),
             *(ROOT / "python" / "fastmha").glob("*.py")]
    paths += [p for p in (ROOT / "csrc").rglob("*") if p.suffix in {".cpp", ".h", ".cu", ".cuh", ".txt"}]
    return read_all(paths)


def cmake_sources():
    return read_all([ROOT / "CMakeLists.txt", *(ROOT / "cmake").rglob("*"), *(ROOT / "csrc").rglob("CMakeLists.txt")])


def package_names():
    return read_all([ROOT / "requirements.txt", ROOT / "pyproject.toml"])


def check_path(token, problems):
    candidate = token[2:] if token.startswith("./") else token
    if "/" in candidate and candidate.split("/")[0] in SOURCE_DIRS and not (ROOT / candidate).exists():
        problems.append(f"{token}: no such file in the repository")
    elif "/" not in candidate and candidate.endswith((".py", ".sh", ".txt", ".toml")) and not (ROOT / candidate).exists():
        problems.append(f"{token}: no such file in the repository")


def check_options(target, text, options, problems):
    for option in options:
        name = option.split("=")[0]
        if not re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text):
            problems.append(f"{target} has no option {name}")


def check_python_command(args, problems):
    if not args or args[0] == "-c":
        return
    if args[0] == "-m":
        module = args[1]
        try:
            spec = importlib.util.find_spec(module)
        except ImportError:
            spec = None
        if spec is None:
            problems.append(f"python -m {module}: no such module")
            return
        if module not in {"pip", "pytest"} and spec.origin and Path(spec.origin).is_file():
            check_options(module, Path(spec.origin).read_text(encoding="utf-8"),
                          [a for a in args[2:] if a.startswith("--")], problems)
        return
    check_script(args, problems)


def check_script(args, problems):
    """`python FILE ...` or `bash FILE ...`: the file exists, and it knows the long options passed to it."""
    positional = [a for a in args if not a.startswith("-")]
    if not positional:
        return
    script = positional[0]
    path = ROOT / (script[2:] if script.startswith("./") else script)
    if script.split("/")[0].lstrip(".") in SOURCE_DIRS | {""} and path.is_file():
        after = args[args.index(script) + 1:]
        check_options(script, path.read_text(encoding="utf-8"), [a for a in after if a.startswith("--")], problems)


def check_pip(args, problems):
    if not args or args[0] != "install":
        return
    names = package_names()
    rest = iter(args[1:])
    for arg in rest:
        if arg in {"-r", "--requirement", "-c", "--constraint"}:
            requirements = next(rest, "")
            if not (ROOT / requirements).is_file():
                problems.append(f"pip install {arg} {requirements}: no such file in the repository")
        elif arg in {"-e", "--editable"}:
            arg = next(rest, "")
            if not (ROOT / arg / "pyproject.toml").is_file():
                problems.append(f"pip install -e {arg}: no pyproject.toml there")
        elif arg.startswith("-"):
            continue
        elif arg == "." or arg.startswith(("./", "../")):
            if not (ROOT / arg / "pyproject.toml").is_file():
                problems.append(f"pip install {arg}: no pyproject.toml there")
        else:
            name = re.split(r"[<>=!~\[;@ ]", arg)[0]
            if not re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", names, re.IGNORECASE):
                problems.append(f"pip install {arg}: {name} is in neither requirements.txt nor pyproject.toml")


def check_shell(code):
    """The problems of a shell block's command lines (an empty list when every line names what exists)."""
    problems, local_variables = [], set()
    sources = switch_sources()
    logical = code.replace("\\\n", " ").splitlines()
    for number, line in enumerate(logical, 1):
        try:
            tokens = shlex.split(line, comments=True)
        except ValueError as error:
            problems.append(f"line {number}: cannot be parsed ({error}): {line}")
            continue
        if not tokens:
            continue
        assignments = []
        while tokens and ASSIGNMENT.match(tokens[0]):
            assignments.append(ASSIGNMENT.match(tokens.pop(0)).group(1))
        if not tokens:  # NAME=value alone: a shell variable of the block
            local_variables.update(assignments)
            continue
        command, args = tokens[0], tokens[1:]
        if command == "export":
            assignments += [ASSIGNMENT.match(a).group(1) for a in args if ASSIGNMENT.match(a)]
        for name in assignments:
            if name not in local_variables and not re.search(rf"\b{name}\b", sources):
                problems.append(f"line {number}: environment switch {name} appears nowhere in the build or sources")
        if command not in COMMANDS and "/" not in command:
            problems.append(f"line {number}: unknown command {command}")
        for token in tokens:
            check_path(token, problems)
            define = re.match(r"^-D(FASTMHA_\w+)=", token)
            if define and not re.search(rf"\b{define.group(1)}\b", cmake_sources()):
                problems.append(f"line {number}: CMake has no option {define.group(1)}")
        if command in {"python", "python3"}:
            check_python_command(args, problems)
        elif command in {"bash", "sh", "source"}:
            check_script(args, problems)
        elif command in {"pip", "pip3"}:
            check_pip(args, problems)
    return problems


# ---- cmake, cpp ----


def check_cmake(code):
    problems = []
    if not re.search(r"find_package\(\s*fastmha\b", code):
        problems.append("no find_package(fastmha)")
    if "fastmha::fastmha" not in code:
        problems.append("does not link fastmha::fastmha")
    return problems


def include_dirs():
    torch_include = Path(torch.__file__).resolve().parent / "include"
    return [torch_include, torch_include / "torch" / "csrc" / "api" / "include", ROOT / "csrc" / "include",
            Path("/usr/include"), *sorted(Path("/usr/include/c++").glob("*"))]


def check_cpp(code):
    problems = []
    directories = include_dirs()
    includes = re.findall(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', code, re.MULTILINE)
    for header in includes:
        if not any((directory / header).is_file() for directory in directories):
            problems.append(f"#include <{header}>: not found in {', '.join(str(d) for d in directories[:3])}")
    if "torch::jit::load" in code and "torch/script.h" not in includes:
        problems.append("torch::jit::load needs #include <torch/script.h>")
    headers = read_all(sorted((ROOT / "csrc" / "include" / "fastmha").glob("*.h")))
    for name in sorted(set(re.findall(r"\bfastmha::(\w+)", code))):
        if not re.search(rf"\b{name}\b", headers):
            problems.append(f"fastmha::{name} is not declared in csrc/include/fastmha")
    return problems


# ---- the tests ----


def test_readme_has_blocks_of_each_kind():
    tags = {block.tag for block in BLOCKS}
    assert {"python", "bash", "cmake", "cpp"} <= tags, tags


def test_every_block_has_a_known_tag():
    unknown = [str(block) for block in BLOCKS if block.tag not in KNOWN_TAGS]
    assert not unknown, f"tag these {sorted(KNOWN_TAGS - {''})} (text: not run): {unknown}"


@blocks_of({"python"})
def test_python_block_runs(block, tmp_path):
    result = run_python(block, tmp_path)
    assert result.returncode == 0, f"{block} failed:\n{block.code}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"


@blocks_of(SHELL_TAGS)
def test_shell_block_names_what_exists(block):
    assert check_shell(block.code) == [], f"{block}:\n{block.code}"


@blocks_of({"cmake"})
def test_cmake_block_uses_the_package(block):
    assert check_cmake(block.code) == [], f"{block}:\n{block.code}"


@blocks_of(CPP_TAGS)
def test_cpp_block_includes_and_names_what_exists(block):
    assert check_cpp(block.code) == [], f"{block}:\n{block.code}"


def anchors(markdown):
    """GitHub's anchors of a Markdown file's headings."""
    headings = re.findall(r"^#+\s+(.*?)\s*$", markdown, re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


def test_links_and_images_resolve():
    broken = []
    for document in [README, *sorted((ROOT / "docs").glob("*.md"))]:
        text = re.sub(r"^```.*?^```", "", document.read_text(encoding="utf-8"), flags=re.MULTILINE | re.DOTALL)
        text = re.sub(r"`[^`\n]*`", "", text)  # inline code
        for target in re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text):
            if re.match(r"^[a-z]+:", target):
                continue  # an address outside the repository
            path, _, anchor = target.partition("#")
            resolved = (document.parent / path).resolve() if path else document
            if not resolved.exists():
                broken.append(f"{document.relative_to(ROOT)}: {target}")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved.read_text(encoding="utf-8")):
                broken.append(f"{document.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, broken


def test_readme_names_nothing_outside_the_repository():
    text = README.read_text(encoding="utf-8")
    found = [word for word in ("shared/", "DESIGN.md") if word in text]
    found += [word for word in ("session", "device time", "issue") if word in text.lower()]
    assert not found, found


def test_the_checks_can_fail(tmp_path):
    assert run_python(Block("python", 1, "raise RuntimeError('boom')\n"), tmp_path).returncode != 0
    assert run_python(Block("python", 2, "import sys\n"), tmp_path).returncode == 0
    assert check_shell("bash scripts/no_such_script.sh\n")
    assert check_shell("FASTMHA_NO_SUCH_SWITCH=1 pip install --no-build-isolation .\n")
    assert check_shell("pip install no-such-package-xyz\n")
    assert check_shell("python -m fastmha.info --no-such-option\n")
    assert check_shell("frobnicate --now\n")
    assert check_shell("cmake -S . -B out -DFASTMHA_NO_SUCH_OPTION=ON\n")
    assert check_cmake("find_package(Torch REQUIRED)\n")
    assert check_cpp("#include <fastmha/no_such_header.h>\n")
    assert check_cpp("#include <torch/torch.h>\nauto m = torch::jit::load(\"m.pt\");\n")
    assert check_cpp("#include <fastmha/fastmha.h>\nfastmha::no_such_function();\n")
    marked = extract_blocks("<!-- not-run -->\n```python\nraise SystemExit(1)\n```\n\n```text\nout\n```\n")
    assert [(b.tag, b.not_run) for b in marked] == [("python", True), ("text", False)]
