#!/usr/bin/env bash
# Sets up a fresh machine for fedge: Debian packages (when root), a virtualenv in .venv
# with the project and its dev extra installed. Idempotent and quick when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."

# systemd: systemd-analyze, which tests/test_deploy_units.py runs on deploy/systemd;
# chromium + chromium-driver: the status page's browser test (tests/test_status_page.py)
debs=(dataset-fashion-mnist mosquitto mosquitto-clients systemd chromium chromium-driver)
missing=()
for pkg in "${debs[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
  if [ "$(id -u)" = 0 ]; then
    echo "setup: installing Debian packages: ${missing[*]}" >&2
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    echo "setup: please install Debian packages: sudo apt-get install ${missing[*]}" >&2
  fi
fi

py=$(command -v python3.11 || command -v python3)
if ! "$py" -c 'import sys; sys.exit(sys.version_info[:2] < (3, 11))'; then
  echo "setup: fedge needs Python >= 3.11, found $("$py" --version)" >&2
  exit 1
fi
[ -x .venv/bin/python ] || "$py" -m venv .venv
stamp=.venv/.fedge-installed
want=$(cat pyproject.toml | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing fedge[dev] into .venv (torch==2.13.0 CPU build)" >&2
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e '.[dev]'
  echo "$want" > "$stamp"
fi
