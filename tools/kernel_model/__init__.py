"""Static performance model of the CUDA decode-attention and append kernels (a MODEL, not a measurement; its decode
timing is calibrated against the committed GPU measurements, and a measurement always wins).

Run from the repository root: `python -m tools.kernel_model [--out FILE] [--fail-if-default-regresses]
[--fail-if-default-not-memory-bound] [--fail-if-append-below-copy-bw] [--calibrate]` (README.md here: method, terms, constants, errors). Modules, imports
pointing down:

    __main__   the command line: analyze, predict, write the JSON records, print, gate
    report     the CI gates and the markdown table
    append     the append kernel's table and prediction
    predict    decode-step records per (GPU, model, batch, context, kernel): ideal bounds, calibrated time
    calibrate  the measurements, the fit of the constants, held-out checks, the calibration records
    decode     the measured decode kernel's steps and chunk classes for the timing model
    fullprec   its full-precision chunk from the SASS: instructions, L1 lines, serial round trips
    constants  the fitted constants and what each means
    timing     the timing model: warps and SMs as a closed queueing network, waves, launches
    analysis   the executed path of one kernel's SASS: counts per key tile and per CTA; the compile/analyze driver
    toolchain  nvcc, nvdisasm, cuobjdump
    kernels    the declared table of the decode kernels
    spec       the table's types
    sass       SASS parsing, basic blocks, loops, source tags
    banks      the shared-memory bank model
    plan       launch plans and occupancy
    shapes     GPUs, model shapes, paths, constants
"""
