#!/usr/bin/env bash
# Regenerate the profiles measured with `hetrain profile` (run from the repository root).
# FLOPs/bytes: charlm and digits counted on this CPU, the published-config models on the meta
# device (shapes only). --measure: layer times on this CPU with 1 thread (one local rank).
set -euo pipefail
H="${PYTHON:-python} -m hetrain"
P=examples/profiles
for ex in digits charlm gpt2-small bert-base resnet50; do
  $H profile --example "$ex" --out "$P/$ex.json"
done
$H profile --example charlm --measure --out "$P/charlm.json" --cluster-out examples/clusters/local-cpu-charlm.yaml
$H profile --example digits --measure --out "$P/digits.json" --microbatch-sizes 4,16,64 --cluster-out examples/clusters/local-cpu-digits.yaml
# the large ones: few sizes and repeats (each pass is seconds to a minute on one thread)
$H profile --example resnet50 --measure --batch 2 --out "$P/resnet50.json" --microbatch-sizes 1,2,4 --repeats 3 --warmup 1 --no-link --cluster-out /dev/null
$H profile --example bert-base --measure --batch 2 --out "$P/bert-base.json" --microbatch-sizes 1,2 --repeats 2 --warmup 1 --no-link --cluster-out /dev/null
$H profile --example gpt2-small --measure --batch 2 --out "$P/gpt2-small.json" --microbatch-sizes 1,2 --repeats 2 --warmup 1 --no-link --cluster-out /dev/null
