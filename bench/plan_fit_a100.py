"""How the one fitted constant of the A100 description was chosen.

Scans matmul_efficiency (the achievable fraction of the 312 TFLOP/s fp16 peak on large GEMMs) on a
0.01 grid and prints mean and max |error| of the planner against Narayanan et al. SC'21 Table 1, all
ten rows together. Every other number of the system file comes from a datasheet or nccl-tests-class
measurement. Run: python bench/plan_fit_a100.py
"""
import dataclasses

from podscale.plan import validate
from podscale.plan.hardware import load_system


def main():
    base = load_system("dgx-a100-80g")
    print(f"{'matmul_eff':>10} {'mean|err|':>10} {'max|err|':>9}  per-row error %")
    grid = {}
    for i in range(60, 81):
        e = i / 100
        system = dataclasses.replace(base, device=dataclasses.replace(base.device, matmul_efficiency=e))
        rows = validate.table1(system)
        grid[e] = [r.error for r in rows]
        mean, worst = validate.summary(rows)
        mark = "  <- catalog" if abs(e - base.device.matmul_efficiency) < 1e-9 else ""
        print(f"{e:>10.2f} {100 * mean:>9.2f}% {100 * worst:>8.2f}%  "
              + " ".join(f"{100 * r.error:+.1f}" for r in rows) + mark)
    # Leave-one-out: fit on nine rows, predict the tenth, to show the fit does not hinge on any row.
    held = []
    for k in range(len(next(iter(grid.values())))):
        best = min(grid, key=lambda e: sum(abs(x) for j, x in enumerate(grid[e]) if j != k))
        held.append((best, grid[best][k]))
    errs = [abs(x) for _, x in held]
    print("leave-one-out: fitted constant per held-out row "
          + " ".join(f"{e:.2f}" for e, _ in held))
    print(f"leave-one-out held-out |error|: mean {100 * sum(errs) / len(errs):.2f}%, max {100 * max(errs):.2f}%")


if __name__ == "__main__":
    main()
