// What this build was made for, as a string in the file: fastddp/_compat.py reads it from
// _C's bytes before loading the module, so that a module built for another torch is
// refused with an ImportError that says what to do, not an undefined-symbol error.
// FASTDDP_BUILD_STAMP comes from setup.py: "fastddp-build-stamp:torch=...;cuda=...;arch=...;".
extern "C" __attribute__((used, visibility("default"))) const char fastddp_build_stamp[] =
    FASTDDP_BUILD_STAMP;
