#!/usr/bin/env bash
# Regenerates docs/report.png, the README's picture of what report.py draws: a short --dummy
# run of each of the five scripts (random data, so the accuracies stay near chance), then
# report.py on them.  Run from anywhere, inside the venv (pip install -r requirements-dev.txt
# gives mpirun).  Takes a few minutes on 2 CPU cores.
set -euo pipefail
cd "$(dirname "$0")/.."
runs=$(mktemp -d)
trap 'rm -rf "$runs"' EXIT
# one thread per process; Open MPI may run as root (containers) and oversubscribe the cores
export OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
    OMPI_MCA_rmaps_base_oversubscribe=1 PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe
small=(--dummy --device cpu --train-limit 256 --test-limit 128 --batch-size 32 --epochs 4)

python resnet_cifar100.py "${small[@]}" --out "$runs/resnet_cifar100"
python resnet_tinyimagenet.py "${small[@]}" --out "$runs/resnet_tinyimagenet"
python pretrained_cifar100.py "${small[@]}" --epochs 2 --no-pretrained --image-size 64 \
    --out "$runs/pretrained_cifar100"
mpirun -np 2 python sync_sgd_cifar100.py "${small[@]}" --out "$runs/sync_sgd_cifar100"
mpirun -np 3 python async_sgd_cifar100.py "${small[@]}" --out "$runs/async_sgd_cifar100"

python report.py "$runs"
cp "$runs/report.png" docs/report.png
