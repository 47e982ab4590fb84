//! `insn_count`: the fixed workloads whose instructions per operation
//! callgrind counts (issue 13, measurement 4).

fn main() {
    println!("insn_count: no workloads yet");
}
