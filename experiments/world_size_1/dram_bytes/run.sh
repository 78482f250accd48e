#!/usr/bin/env bash
# On the device machine: ncu_memory.py under Nsight Compute (full set, caches flushed: cold), then the
# report's memory counters, its details page and each kernel's SASS with per-instruction counts and
# stall samples, as CSV under $OUT (the SASS pages in sass.tgz).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=.
export MOE_AR_CACHE_DIR=$(mktemp -d)
D=$(mktemp -d)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/gpu.txt"
ncu --version >> "$OUT/gpu.txt"
ncu --clock-control none --cache-control all -k regex:'^(fused|moe_ar)' --set full --import-source no \
  -o "$D/mem" python3 experiments/world_size_1/dram_bytes/ncu_memory.py > "$OUT/ncu_log.txt" 2>&1
M=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed
M=$M,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sectors_srcunit_tex_op_write.sum,lts__t_sector_op_read_hit_rate.pct
M=$M,smsp__inst_executed.sum,launch__registers_per_thread,launch__grid_size,launch__block_size,sm__warps_active.avg.per_cycle_active
ncu -i "$D/mem.ncu-rep" --page raw --csv --metrics "$M" > "$OUT/metrics.csv" 2>&1
ncu -i "$D/mem.ncu-rep" --page details --csv > "$OUT/details.csv" 2>&1
# one kernel at a time: the second launch of each (ids 1, 3, ..., 11)
for i in 1 3 5 7 9 11; do
  ncu -i "$D/mem.ncu-rep" --page source --csv --print-source sass --launch-skip $i --launch-count 1 \
    > "$OUT/sass_$i.csv" 2>&1 || true
done
# the device tool brings back at most 8 files: the SASS pages in one archive
gzip -f "$OUT/details.csv"
tar -czf "$OUT/sass.tgz" -C "$OUT" $(cd "$OUT" && ls sass_*.csv) && rm -f "$OUT"/sass_*.csv
ls -la "$D" >> "$OUT/ncu_log.txt"
