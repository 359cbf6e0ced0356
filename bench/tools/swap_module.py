"""Run a script with one module of the package replaced by another file: an A/B of one module
(a baseline's version, e.g. `git show <commit>:engine/vision/encoder.py > _ab/encoder.py`)
without carrying a whole second tree to the GPU machine.

    python bench/tools/swap_module.py deltaspec.engine.vision.encoder _ab/encoder.py \\
        bench/vision_encoder.py --sides 448,1024 --out "$OUT/base"

The package is imported first with the tree's module (the replacement's relative imports need
it), then the replacement is loaded under its own name and put in the module's place; what the
script imports from that module afterwards is the replacement's. Modules that imported names
from the tree's module before keep the tree's.
"""

import importlib.util
import runpy
import sys
from pathlib import Path

module_name, path, script, *arguments = sys.argv[1:]
importlib.import_module(module_name.rpartition(".")[0])
spec = importlib.util.spec_from_file_location(f"{module_name}_swapped", path)
module = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = module  # (dataclasses look their class's module up while it loads)
spec.loader.exec_module(module)
sys.modules[module_name] = module
sys.argv = [script, *arguments]
sys.path.insert(0, str(Path(script).parent))
runpy.run_path(script, run_name="__main__")
