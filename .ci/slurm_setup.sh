#!/usr/bin/env bash
# CI set-up for tests/slurm: install Slurm (slurm-wlm) and munge from Debian's packages
# when they are missing (about a minute). Needs root; does not start anything: the tests
# start their own one-node cluster under a temporary folder (tests/slurm/cluster.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
exec bash tests/slurm/cluster.sh install
