#!/usr/bin/env bash
# Regenerate the profiles measured with `hetrain profile` (run from the repository root).
# FLOPs/bytes: charlm and digits counted on this CPU, the published-config models on the meta
# device (shapes only). --measure: layer times on this CPU with 1 thread (one local rank),
# micro-batch sizes interleaved; the large models with few sizes and repeats (one pass of
# GPT-2 small at micro-batch 1 takes tens of seconds on one thread).
set -euo pipefail
H="${PYTHON:-python} -m hetrain"
P=examples/profiles
C=examples/clusters
$H profile --example charlm --measure --out "$P/charlm.json" --cluster-out "$C/local-cpu-charlm.yaml"
$H profile --example digits --measure --out "$P/digits.json" --microbatch-sizes 4,16,64 \
  --cluster-out "$C/local-cpu-digits.yaml"
$H profile --example resnet50 --measure --out "$P/resnet50.json" --microbatch-sizes 1,2,4 \
  --repeats 3 --warmup 1 --no-link --cluster-out "$P/resnet50.cluster.yaml"
$H profile --example bert-base --measure --out "$P/bert-base.json" --microbatch-sizes 1,2,4 \
  --repeats 2 --warmup 1 --no-link --cluster-out "$P/bert-base.cluster.yaml"
$H profile --example gpt2-small --measure --out "$P/gpt2-small.json" --microbatch-sizes 1,2 \
  --repeats 2 --warmup 1 --no-link --cluster-out "$P/gpt2-small.cluster.yaml"
