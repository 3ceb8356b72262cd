#!/bin/bash
# usage: run_configs.sh CORPUS OUT < configs (lines: name|extra_xla_flags|jaxcfg)
cd /work/main
B="--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
while IFS='|' read -r name extra jcfg; do
  [ -z "$name" ] && continue
  r=$(XLA_FLAGS="$B $extra" JAXCFG="$jcfg" .venv/bin/python benchmarks/results/xla_cpu_compile_replay_2026-11-30.py $1 2>/tmp/err_$name.log | tail -1)
  echo "$name | $1 | $r" | tee -a $2
done
