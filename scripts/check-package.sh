#!/usr/bin/env bash
# The package as a user gets it: build the sdist and the wheel (from the sdist), with no
# deprecation warning; install the wheel into a fresh venv (no .venv, no source tree on the
# path; torch: the CPU build already in pip's cache or wheel directory, never a CUDA one) and
# smoke-test it there: `gdsckpt --version`, a save/load round trip, the CLI on the saved file.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh bench
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
t0=$SECONDS
step() { echo "[package $((SECONDS - t0))s] $*" >&2; }
step "building the sdist and the wheel"
setup_pip
"${_setup_pip[@]}" install --progress-bar off -q "build>=1"
# --no-isolation: with .venv's setuptools (setup.sh installs the floor pyproject's build-system
# names), not two throwaway venvs that each download and install setuptools; build still checks
# that .venv meets build-system.requires, and fails if not.
.venv/bin/python -m build --no-isolation --outdir "$work/dist" . >"$work/build.log" 2>&1 \
  || { cat "$work/build.log"; exit 1; }
if grep -i "deprecat" "$work/build.log"; then
  step "the build warned of deprecated settings (above)"; exit 1
fi
ls "$work/dist"
torch_version=$(.venv/bin/python -c "import torch; print(torch.__version__)")
step "installing the wheel into a fresh venv (torch $torch_version)"
# No pip of its own where this Python's pip can install into it (setup.sh says why); --no-compile:
# no bytecode for torch's thousands of modules, most never imported here.
python3 -m venv --without-pip "$work/venv"
venv_pip=(python3 -m pip --python "$work/venv/bin/python")
if ! "${venv_pip[@]}" --version >/dev/null 2>&1; then
  "$work/venv/bin/python" -m ensurepip -q
  venv_pip=("$work/venv/bin/python" -m pip)
fi
"${venv_pip[@]}" install --progress-bar off --no-compile -q "torch==$torch_version" "$work"/dist/*.whl
step "smoke test"
cd "$work"
"$work/venv/bin/gdsckpt" --version
"$work/venv/bin/python" - <<'PY'
import gdsckpt, torch, pathlib
assert "site-packages" in gdsckpt.__file__, gdsckpt.__file__  # the wheel's copy, not the source tree
assert (pathlib.Path(gdsckpt.__file__).parent / "format" / "FORMAT.md").is_file()
model = torch.nn.Linear(64, 64)
opt = torch.optim.AdamW(model.parameters())
model(torch.randn(4, 64)).sum().backward()
opt.step()
gdsckpt.save({"model": model, "optim": opt, "step": 3}, "smoke.gdsckpt")
out = gdsckpt.load("smoke.gdsckpt")
assert out["step"] == 3 and torch.equal(out["model"]["weight"], model.weight.detach())
assert torch.equal(out["optim"]["state"][0]["exp_avg"], opt.state[model.weight]["exp_avg"])
print("round trip: bit-exact")
PY
"$work/venv/bin/gdsckpt" verify --deep smoke.gdsckpt
"$work/venv/bin/gdsckpt-bench" --help >/dev/null
step "the wheel installs and runs"
