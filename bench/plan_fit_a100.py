"""How the one fitted constant of the A100 description was chosen, and how well it predicts what it was not
fitted to.

Scans matmul_efficiency (the achievable fraction of the tensor-core peak per SM on a full tile, which the
GEMM shape model of podscale/plan/compute.py turns into each GEMM's rate) on a 0.01 grid and prints mean
and max |error| over Narayanan et al. SC'21 Table 1 (the fitting set, all ten rows together), the
leave-one-out errors (fit on nine rows, predict the tenth), and, for reference only, the validation set's
errors at each grid value (never used to choose). Every other number of the system file comes from a
datasheet, the GEMM kernels' structure or an nccl-tests-class measurement.
Run: python bench/plan_fit_a100.py
"""
import dataclasses

from podscale.plan import validate
from podscale.plan.hardware import load_system


def main():
    base = load_system("dgx-a100-80g")
    curve = validate.fitting_curve(base)
    chosen = validate.fit_efficiency(curve)
    print(f"{'matmul_eff':>10} {'mean|err|':>10} {'max|err|':>9}  per-row error % (Table 1)")
    for e, errs in curve.items():
        mean, worst = validate.summary(errs)
        mark = "  <- fitted" if e == chosen else ""
        mark += "  (catalog)" if abs(e - base.device.matmul_efficiency) < 1e-9 else ""
        print(f"{e:>10.2f} {100 * mean:>9.2f}% {100 * worst:>8.2f}%  " + " ".join(f"{100 * x:+.1f}" for x in errs)
              + mark)
    loo = validate.leave_one_out(base, curve)
    mean, worst = validate.summary([err for _, err in loo])
    print("leave-one-out: constant fitted without each row " + " ".join(f"{e:.2f}" for e, _ in loo))
    print(f"leave-one-out held-out |error|: mean {100 * mean:.2f}%, max {100 * worst:.2f}%")
    jz = load_system("jean-zay-a100")
    print("validation set at each grid value (reference only, not used to fit):")
    for e in curve:
        sysmap = {"dgx-a100-80g": dataclasses.replace(base, device=dataclasses.replace(base.device,
                                                                                       matmul_efficiency=e)),
                  "jean-zay-a100": dataclasses.replace(jz, device=dataclasses.replace(jz.device,
                                                                                       matmul_efficiency=e))}
        mean, worst = validate.summary(validate.validation_set(sysmap))
        print(f"{e:>10.2f} {100 * mean:>9.2f}% {100 * worst:>8.2f}%")


if __name__ == "__main__":
    main()
