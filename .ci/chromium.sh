# Source this (`. .ci/chromium.sh`): Debian's chromium for the dashboard test (tests/test_review.py renders optuna-dashboard
# headless and keeps a screenshot); installs it when missing. Idempotent; prints nothing unless it fails.
command -v chromium >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } >/dev/null || return 1
