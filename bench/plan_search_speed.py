"""Search speed of the planner: layouts predicted per second (goal: >= 10^4 layouts in <= 5 s).

    python bench/plan_search_speed.py
"""
from podscale.plan import Layout, predict, search
from podscale.plan.search import published_gpt175b_layout

CASES = [("dgx-a100-superpod", 1024, "gpt-175b", 1536), ("tpu-v4-pod", 1024, "gpt-175b", 1536),
         ("dgx-a100-80g", 64, "moe-1.3b-64e", 512)]


def main():
    for system, devices, model, batch in CASES:
        r = search(system, devices, model, batch, top=1)
        best = r.ranked[0]
        print(f"{model} on {devices} x {system}: {r.evaluated} layouts in {r.seconds:.2f} s "
              f"({r.evaluated / r.seconds:,.0f}/s), {r.rejected_memory} do not fit; best "
              f"{Layout(**best.layout).short()} {best.tflops_per_device:.0f} TFLOP/s/device, MFU {best.mfu:.1%}")
    pub = predict("dgx-a100-superpod", 1024, "gpt-175b", published_gpt175b_layout(), 1536)
    print(f"published GPT-3 175B layout {published_gpt175b_layout().short()}: {pub.tflops_per_device:.0f} "
          f"TFLOP/s/GPU (paper: 140), {pub.days_to_train(300e9):.1f} days for 300B tokens (paper: 34)")


if __name__ == "__main__":
    main()
