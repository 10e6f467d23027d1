"""nkisim depends on nothing of the application: no module of the package imports (at any level, function-level
imports included) the project's model, kernels, megakernel or harness."""
import ast
from pathlib import Path

import nkisim

APPLICATION = ("model", "nki_kernels", "megakernel", "harness", "scripts", "tests")


def test_nkisim_imports_nothing_of_the_application():
    pkg = Path(nkisim.__file__).parent
    found = []
    for path in sorted(pkg.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            found += [f"{path.relative_to(pkg)}:{node.lineno} imports {n}" for n in names
                      if n.split(".")[0] in APPLICATION]
    assert not found, found
