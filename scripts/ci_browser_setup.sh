#!/usr/bin/env bash
# Installs what tests/test_browser.py needs: Debian's chromium (driven by the playwright Python
# package, a dev dependency, through its executable path; `playwright install` is never run).
set -euo pipefail

if [ -x /usr/bin/chromium ]; then
  echo "ci_browser_setup: /usr/bin/chromium present: $(/usr/bin/chromium --version 2>/dev/null || true)"
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then
    SUDO="sudo"
  else
    echo "ci_browser_setup: installing chromium needs root (apt-get); run as root" >&2
    exit 1
  fi
fi

export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends chromium fonts-dejavu-core
/usr/bin/chromium --version
