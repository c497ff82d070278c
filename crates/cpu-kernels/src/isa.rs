//! Which SIMD instruction set the kernels use, detected once per process. A lower level can
//! be forced (benchmarks and tests compare the paths in one run); a higher one cannot.

use std::sync::atomic::{AtomicU8, Ordering};

/// Instruction sets the kernels are written for, lowest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Isa {
    /// Plain Rust, any CPU.
    Portable,
    /// AVX2 + FMA (8 f32 lanes).
    Avx2,
    /// AVX-512 F/BW/VL (16 f32 lanes).
    Avx512,
}

impl Isa {
    /// The name used in logs and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Portable => "portable",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }

    /// Parses [`Isa::name`].
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "portable" => Some(Isa::Portable),
            "avx2" => Some(Isa::Avx2),
            "avx512" => Some(Isa::Avx512),
            _ => None,
        }
    }

    fn from_u8(v: u8) -> Self {
        match v {
            2 => Isa::Avx512,
            1 => Isa::Avx2,
            _ => Isa::Portable,
        }
    }
}

impl std::fmt::Display for Isa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What this CPU supports.
pub fn detected() -> Isa {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vl")
        {
            return Isa::Avx512;
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            return Isa::Avx2;
        }
    }
    Isa::Portable
}

/// Extra features reported beside the ISA in logs (AVX-512 BF16, AMX), for the record.
pub fn features() -> Vec<&'static str> {
    let mut out = Vec::new();
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512bf16") {
            out.push("avx512_bf16");
        }
        // AMX detection is not in `is_x86_feature_detected!` on stable: CPUID leaf 7,
        // sub-leaf 0, EDX bits 22 (AMX-BF16) and 24 (AMX-TILE).
        let leaf7 = std::arch::x86_64::__cpuid_count(7, 0);
        if leaf7.edx & (1 << 24) != 0 && leaf7.edx & (1 << 22) != 0 {
            out.push("amx_bf16");
        }
    }
    out
}

const UNSET: u8 = u8::MAX;
static CHOSEN: AtomicU8 = AtomicU8::new(UNSET);

/// The instruction set the kernels use: what the CPU has, unless [`limit`] lowered it.
pub fn current() -> Isa {
    match CHOSEN.load(Ordering::Relaxed) {
        UNSET => {
            let isa = detected();
            CHOSEN.store(isa as u8, Ordering::Relaxed);
            isa
        }
        v => Isa::from_u8(v),
    }
}

/// Whether bf16 products of prefill size may round their activations to bf16 and use the
/// CPU's bf16 dot-product instructions (AVX-512 BF16 `vdpbf16ps`): the CPU has them, the
/// kernels run AVX-512, and `TANDEM_CPU_BF16_DOT=0` does not turn them off.
pub fn bf16_dot() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let has = *ON.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        let cpu = std::arch::is_x86_feature_detected!("avx512bf16");
        #[cfg(not(target_arch = "x86_64"))]
        let cpu = false;
        cpu && std::env::var("TANDEM_CPU_BF16_DOT").map_or(true, |v| v != "0")
    });
    has && current() == Isa::Avx512
}

/// Uses at most `isa` from now on (the lower of it and what the CPU has); returns the choice.
pub fn limit(isa: Isa) -> Isa {
    let chosen = isa.min(detected());
    CHOSEN.store(chosen as u8, Ordering::Relaxed);
    chosen
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_limit_never_raises() {
        for isa in [Isa::Portable, Isa::Avx2, Isa::Avx512] {
            assert_eq!(Isa::parse(isa.name()), Some(isa));
        }
        assert_eq!(Isa::parse("sse"), None);
        assert_eq!(limit(Isa::Portable), Isa::Portable);
        assert_eq!(current(), Isa::Portable);
        assert_eq!(limit(Isa::Avx512), detected());
    }
}
